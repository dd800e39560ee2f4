"""`xtokspec distill`: its options (one per `DistillSettings` field) and the command."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .common import DTYPES, prompt_chars, show_library_log


def _distill(args: argparse.Namespace) -> int:
    from ..distill.pipeline import DistillSettings, distill, summary_lines

    show_library_log()
    # NOTE: every DistillSettings field is the destination of one option (--lr: learning_rate)
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillSettings)} | {"modes": tuple(args.modes)}
    try:
        report = distill(
            args.target, args.draft, args.prompts, args.out, eval_prompts=args.eval_prompts,
            max_seconds=args.max_seconds, overwrite=args.overwrite, resume=args.resume,
            target_device=args.target_device, draft_device=args.draft_device, progress=not args.no_progress, **settings,
        )
    except KeyboardInterrupt:
        print(f"xtokspec: interrupted; the data and the last checkpoint are in {args.out}.partial: run the same "
              "command with --resume to continue, or with --overwrite to start over", file=sys.stderr)
        return 130
    data, training = report["data"], report["training"]
    print(f"[xtokspec] distilled {report['draft']} for {report['target']} into {args.out}: "
          f"{data['continuations']} continuations, {training['steps']} steps, {report['distill_seconds']:.0f} s "
          f"(data {data['seconds']:.0f} s, training {training['seconds']:.0f} s)", file=sys.stderr)
    for line in summary_lines(report):
        print(f"[xtokspec] {line}", file=sys.stderr)
    return 0


def add_distill_parser(sub, formatter_class) -> None:
    from ..distill.pipeline import DistillSettings

    d = DistillSettings()
    dis = sub.add_parser(
        "distill", formatter_class=formatter_class,
        help="align a draft (any tokenizer) to a target: train it on the target's continuations of your prompts",
        description="Distil a target into a draft of any tokenizer xtokspec bridges: the target continues your "
        "prompts (greedy and sampled), the draft is fine-tuned on that text in its own tokenization (the prompt "
        "out of the loss), and the result is written to --out as a model folder that loads like any draft "
        "(XTokSpec(target, OUT)), with distill_report.json beside the weights. Before and after, on held-out "
        "prompts that training never sees: greedy per-token acceptance, tokens per target call at "
        "--eval-temperature and the greedy speed-up over the target alone, drafting every cycle. The work goes "
        "into OUT.partial/ and is renamed to OUT at the end; an interrupted run continues with --resume.",
    )
    dis.add_argument("--target", required=True, help="target (large) model: a folder, a hub id, or a bundled name")
    dis.add_argument("--draft", required=True, help="draft (small) model to distil: a folder, a hub id, or a bundled name")
    dis.add_argument("--prompts", required=True, metavar="FILE",
                     help="training prompts: a UTF-8 text file, one prompt per line, or .jsonl with a \"prompt\" or "
                     "\"text\" field")
    dis.add_argument("--out", required=True, metavar="DIR", help="folder of the distilled draft (must not exist, "
                     "unless --overwrite)")
    dis.add_argument("--eval-prompts", default=None, metavar="FILE",
                     help="held-out prompts for the before/after evaluation (same formats); by default "
                     "--eval-count prompts of --prompts are held out and never trained on")
    dis.add_argument("--eval-count", type=int, default=d.eval_count,
                     help="held-out prompts run through the decoder before and after (0: none)")
    dis.add_argument("--agreement-count", type=int, default=d.agreement_count,
                     help="held-out prompts of the teacher-forced agreement with the target's greedy text, before "
                     "and after, with a 95%% interval on the gain: one draft forward per prompt, so many prompts "
                     "are cheap and narrow the interval (0: the --eval-count ones)")
    dis.add_argument("--max-prompts", type=int, default=None, help="train on at most this many prompts (default: all)")
    dis.add_argument("--prompt-chars", type=prompt_chars, default=None, metavar="MIN-MAX",
                     help="cut each training prompt to a seeded length of MIN to MAX characters (for paragraphs "
                     "of a corpus used as prompts)")
    dis.add_argument("--new-tokens", type=int, default=d.new_tokens, help="target tokens per continuation")
    dis.add_argument("--modes", nargs="+", choices=("greedy", "sampled"), default=list(d.modes),
                     help="continuations per prompt: greedy, sampled (T=1, the full distribution), or both")
    dis.add_argument("--gen-batch", type=int, default=d.gen_batch, help="prompts per batched target generate")
    dis.add_argument("--engine", choices=["transformers", "vllm"], default=d.engine,
                     help="what generates the target's continuations: transformers' generate, or vLLM (installed "
                          "separately; it loads the target a second time, for generation only)")
    dis.add_argument("--max-steps", type=int, default=d.max_steps, help="training steps")
    dis.add_argument("--max-seconds", type=float, default=None,
                     help="wall budget for data and training: generation stops starting batches past half of it, "
                     "training stops at it (evaluation comes on top)")
    dis.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per training step")
    dis.add_argument("--lr", dest="learning_rate", metavar="LR", type=float, default=d.learning_rate,
                     help="peak learning rate (warmup, cosine decay)")
    dis.add_argument("--max-length", type=int, default=d.max_length, help="draft tokens per training sequence")
    dis.add_argument("--lora", action="store_true", help="train LoRA adapters (needs peft) and merge them into "
                     "the saved draft, instead of training every weight")
    dis.add_argument("--lora-rank", type=int, default=d.lora_rank, help="LoRA rank (with --lora)")
    dis.add_argument("--freeze-embeddings", action="store_true",
                     help="train every weight but the input embeddings (and an output head tied to them): faster "
                     "steps where the vocabulary is most of the draft")
    dis.add_argument("--token-loss", type=float, default=d.token_loss, metavar="WEIGHT",
                     help="add a token-level cross-tokenizer loss with this weight: at each continuation position "
                     "where both tokenizations start a token at the same byte, cross-entropy of the draft's next "
                     "token against the target's top ids there that the draft has as one token of the same bytes "
                     "(0: sequence-level alone)")
    dis.add_argument("--token-top-k", type=int, default=d.token_top_k,
                     help="target probabilities kept per position for --token-loss")
    dis.add_argument("--cut-share", type=float, default=d.cut_share, metavar="SHARE",
                     help="share of the training sequences tokenized as the text bridge shows text to the draft at "
                     "a cycle start: cut at a target token boundary that falls inside one of the draft's own "
                     "tokens (0: none)")
    dis.add_argument("--eval-new-tokens", type=int, default=d.eval_new_tokens, help="tokens per held-out prompt")
    dis.add_argument("--eval-temperature", type=float, default=d.eval_temperature,
                     help="temperature of the sampled evaluation (tokens per target call)")
    dis.add_argument("--seed", type=int, default=d.seed, help="seed of the prompt split, sampling and training")
    dis.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                     help="both models' dtype for generation and evaluation (training keeps float32 weights "
                     "with bfloat16 autocast where the hardware has it); the draft is saved in its own dtype")
    dis.add_argument("--target-device", default=None, help="e.g. cuda:0")
    dis.add_argument("--draft-device", default=None, help="e.g. cuda:0 (training runs there)")
    dis.add_argument("--overwrite", action="store_true",
                     help="replace an existing --out (kept until the new draft is complete), or discard an "
                     "interrupted run's OUT.partial/ and start over")
    dis.add_argument("--resume", action="store_true",
                     help="continue an interrupted run from OUT.partial/ (its data and last checkpoint)")
    dis.add_argument("--no-progress", action="store_true", help="no progress bars")
    dis.set_defaults(func=_distill)
