"""Sequence-level distillation alone against sequence-level plus the token-level loss, or with a share of the
sequences cut where the bridge leaves the draft (`--cut-share`), on the same data for the same steps: `xtokspec
distill`'s training (`training_examples`, `train_draft`) run once per (token-loss weight, cut share) on one run's
continuations (its distill_data.jsonl; a token-loss weight needs the target's top ids: a run made with
--token-loss), each trained draft saved under OUT/<name>/ for benchmarks/distill_agreement.py or
benchmarks/draft_compare.py to score.

    python benchmarks/distill_losses.py --target ~/.cache/xtokspec/real/qwen2.5-coder-1.5b \\
        --draft ~/.cache/xtokspec/real/gemma-3-270m --data RUN/distill_data.jsonl --weights 0 1 --out DIR
    python benchmarks/distill_agreement.py --target ... --base ... --distilled DIR/sequence-level \\
        DIR/sequence+token-level --out DIR/agreement
    python benchmarks/distill_losses.py ... --weights 0 --cut-shares 0 0.5 --out DIR   # then draft_compare.py
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from xtokspec import XTokSpec
from xtokspec.distill.pipeline import DistillSettings, train_draft, training_examples
from xtokspec.distill.train import target_to_draft_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--data", type=Path, required=True, help="a run's distill_data.jsonl (with target_top)")
    parser.add_argument("--weights", type=float, nargs="+", default=[0.0, 1.0], help="token-loss weights")
    parser.add_argument("--cut-shares", type=float, nargs="+", default=[0.0],
                        help="shares of the sequences cut at a target token boundary inside a draft token")
    parser.add_argument("--learning-rates", type=float, nargs="+", default=[DistillSettings.learning_rate],
                        help="peak learning rates (one arm each; an arm at another than the default is named +lrX)")
    parser.add_argument("--freeze-embeddings", action="store_true",
                        help="DistillSettings(freeze_embeddings=True): arms named +frozen-embeddings")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = [json.loads(line) for line in args.data.read_text(encoding="utf-8").splitlines()]
    if any(args.weights) and not all("target_top" in r for r in records):
        parser.error(f"{args.data} has no target_top: use the data of a run made with --token-loss")
    spec = XTokSpec(args.target, args.draft, large_kwargs={"dtype": torch.bfloat16},
                    small_kwargs={"dtype": torch.bfloat16})
    target_to_draft = target_to_draft_ids(spec.vocab_maps.token_map)
    summaries = {}
    arms = [(w, c, lr) for w in args.weights for c in args.cut_shares for lr in args.learning_rates]
    for weight, cut_share, lr in arms:
        name = (("sequence+token-level" if weight else "sequence-level") + (f"+cuts{cut_share:g}" if cut_share else "")
                + (f"+lr{lr:g}" if lr != DistillSettings.learning_rate else "")
                + ("+frozen-embeddings" if args.freeze_embeddings else ""))
        settings = DistillSettings(max_steps=args.steps, batch_size=args.batch_size, max_length=args.max_length,
                                   token_loss=weight, cut_share=cut_share, learning_rate=lr,
                                   freeze_embeddings=args.freeze_embeddings, seed=0)
        examples = training_examples(spec.draft_tokenizer, records, args.max_length, spec.draft,
                                     target_to_draft if weight else None, spec.target, cut_share, seed=0)
        torch.manual_seed(0)
        student = copy.deepcopy(spec.draft_model).to(torch.float32).train()
        start = time.perf_counter()
        student, summary = train_draft(student, spec.draft_tokenizer, examples, settings, args.out / f"work-{name}",
                                       progress=False)
        summary["wall_seconds"] = time.perf_counter() - start
        student.to(torch.bfloat16).save_pretrained(args.out / name)
        spec.draft_tokenizer.save_pretrained(args.out / name)
        summaries[name] = {"token_loss": weight, "cut_share": cut_share, "learning_rate": lr, **summary}
        print(f"{name}: {summary['steps']} steps, {summary['wall_seconds']:.0f} s, loss "
              f"{summary['first_logged_loss']:.2f} -> {summary['last_logged_loss']:.2f}", flush=True)
    default = (args.weights == [0.0, 1.0] and args.cut_shares == [0.0] and not args.freeze_embeddings
               and args.learning_rates == [DistillSettings.learning_rate])
    suffix = "" if default else "-" + "-".join(summaries)
    (args.out / f"training{suffix}.json").write_text(json.dumps(summaries, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
