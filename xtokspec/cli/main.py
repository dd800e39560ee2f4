"""Command line: `xtokspec generate`, `xtokspec bench`, `xtokspec distill`."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

from .. import __version__
from ..options import compile_choice
from ..runtime.models import CPU_LINEARS, FIXTURE_NAMES, check_source
from ..types import TREE_ROOTS, ProposalKind, SamplingParams, SpecConfig, XTokSpecError, check_prompt
from .bench import add_bench_parser, calibration_lines, read_text
from .common import DTYPES, HelpFormatter, show_library_log
from .distill_cmd import add_distill_parser

_STOPPED = {"eos": "the target emitted EOS", "length": "--max-new-tokens reached",
            "context": "the target's context is full (max_position_embeddings)"}


def _load_kwargs(dtype: str, device: str | None) -> dict:
    import torch

    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if device:
        kwargs["device_map"] = device
    return kwargs


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt from the argument, from stdin ('-') or from --prompt-file (one trailing newline dropped)."""
    if args.prompt_file is not None and args.prompt is not None:
        raise XTokSpecError("give the prompt either as an argument or with --prompt-file, not both")
    if args.prompt_file is None and args.prompt is None:
        raise XTokSpecError("no prompt: give it as an argument, '-' to read stdin, or --prompt-file PATH")
    if args.prompt_file is not None:
        text = read_text(args.prompt_file, "--prompt-file")
    elif args.prompt == "-":
        text = sys.stdin.read()
    else:
        return args.prompt
    return text[:-1] if text.endswith("\n") else text


def _calibration(args: argparse.Namespace) -> list[str] | None:
    """--calibration's non-empty lines (for --draft-vocab), or None when the head is not trimmed."""
    if args.draft_vocab is None:
        if args.calibration is not None:
            raise XTokSpecError("--calibration is the text --draft-vocab N chooses ids from: give --draft-vocab too")
        return None
    if args.draft_vocab <= 0:
        raise XTokSpecError(f"--draft-vocab must be a positive integer, got {args.draft_vocab}")
    if args.calibration is None:
        raise XTokSpecError("--draft-vocab needs --calibration FILE: text in the domain you will generate "
                            "(one document or paragraph per line)")
    return calibration_lines(args.calibration)


def _sampling(args: argparse.Namespace) -> tuple[bool | None, list[str]]:
    """(do_sample, notes): --temperature/--top-k/--top-p imply --sample; --temperature 0 means greedy."""
    given = [f"--{name.replace('_', '-')}" for name in ("temperature", "top_k", "top_p") if getattr(args, name) is not None]
    if args.sample:
        return True, []
    if args.keyed and not given and args.temperature != 0:
        return True, ["--keyed implies --sample"]
    if args.temperature == 0:
        return False, ["temperature 0: greedy decoding"]
    if given:
        return True, [f"{' and '.join(given)} {'implies' if len(given) == 1 else 'imply'} --sample"]
    return None, []  # the target's generation_config decides (greedy for the bundled models)


def _generate(args: argparse.Namespace) -> int:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # NOTE: before this process adds its own
    # Everything that can be checked without the models is checked first (loading takes seconds).
    prompt = _read_prompt(args)
    if args.compare_runs < 1:
        raise XTokSpecError(f"--compare-runs must be a positive integer, got {args.compare_runs}")
    check_prompt(prompt)
    if args.max_new_tokens <= 0:
        raise XTokSpecError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    do_sample, notes = _sampling(args)
    calibration = _calibration(args)
    if do_sample:
        SamplingParams(do_sample=True, temperature=1.0 if args.temperature is None else args.temperature,
                       top_k=args.top_k or 0, top_p=1.0 if args.top_p is None else args.top_p, seed=args.seed,
                       keyed=args.keyed)
    elif args.keyed:
        raise XTokSpecError("--keyed is a way of sampling: it does not go with greedy decoding (--temperature 0)")
    if args.cpu_linears == "onednn" and (args.dtype != "float32" or args.compile in (True, "inductor", "graphs")):
        raise XTokSpecError("--cpu-linears onednn needs --dtype float32 and no --compile (oneDNN's packed float32 "
                            "linears on the CPU)")
    check_source(args.target, "target (large)")  # NOTE: both named before either loads (XTokSpec checks again)
    check_source(args.draft, "draft (small)")
    config = SpecConfig(
        num_draft_tokens=args.num_draft_tokens, max_draft_tokens=max(12, args.num_draft_tokens),
        adaptive=not args.fixed_k, proposal=args.proposal, tree_width=args.tree_width, tree_root=args.tree_root,
        cache=args.cache, compile=args.compile, fallback=not args.always_draft, draft_healing=not args.no_healing,
    )
    for note in notes:
        print(f"[xtokspec] note: {note}", file=sys.stderr)

    from ..spec import XTokSpec
    from ..types import GenerationStats

    show_library_log()  # NOTE: no "Loading weights" bars: XTokSpec loads without them unless progress=True
    spec = XTokSpec(
        args.target, args.draft, config=config,
        large_kwargs=_load_kwargs(args.dtype, args.target_device),
        small_kwargs=_load_kwargs(args.dtype, args.draft_device),
    )
    if calibration is not None:
        print(f"[xtokspec] {spec.trim_draft_vocab(calibration, args.draft_vocab).describe()}", file=sys.stderr)
    if args.cpu_linears == "onednn":  # NOTE: after trimming, which slices the draft's torch head
        from ..runtime.models import onednn_linears

        counts = [onednn_linears(model) for model in (spec.target_model, spec.draft_model)]
        print(f"[xtokspec] oneDNN linears: {counts[0]} in the target, {counts[1]} in the draft", file=sys.stderr)
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=do_sample, seed=args.seed, keyed=args.keyed,
                  temperature=None if do_sample is False else args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.chat:  # the prompt as one user message, rendered with the target's chat template
        prompt, kwargs["messages"] = None, [{"role": "user", "content": prompt}]
    stats = GenerationStats()
    if args.stream:
        pieces = []
        for piece in spec.stream(prompt, stats=stats, **kwargs):
            print(piece, end="", flush=True)
            pieces.append(piece)
        print()
        text = "".join(pieces)
    else:
        result = spec.generate(prompt, **kwargs)
        print(result.text)
        stats, text = result.stats, result.text
    print(f"[xtokspec] {spec.describe()}", file=sys.stderr)
    kind = stats.proposal
    if stats.proposal == ProposalKind.AUTO.value:  # chosen each cycle: say which kinds ran, how often
        kind += " (" + ", ".join(f"{k} {n}" for k, n in sorted(stats.proposal_cycles.items())) + " cycles)"
    print(f"[xtokspec] {kind}: {stats.summary()}; stopped: {_STOPPED[stats.stop_reason]}", file=sys.stderr)
    if args.compare:
        _compare(spec, prompt, kwargs, text, args.compare_runs, load)
    return 0


WIDE_SPREAD = 0.10  # --compare notes a spread of ratios wider than this: interquartile range over the median
BUSY_MARGIN = 0.5  # --compare notes other work when it and this process's threads want this many CPUs more than exist


def time_sides(ours: Callable[[], int], alone: Callable[[], int], runs: int,
               clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], list[float]]:
    """Tokens per second of each side over `runs` pairs of runs, after one untimed run of `alone` (xtokspec's
    first run is the one whose text was printed, also untimed). Pairs alternate which side goes first (xtokspec
    first in even pairs), so that a drift of the machine's speed hits both alike. Each side returns its tokens."""
    alone()  # warm-up: the target alone's first forwards in this process
    ours_tps, alone_tps = [], []
    for pair in range(runs):
        for side in ((ours, alone) if pair % 2 == 0 else (alone, ours)):
            start = clock()
            tokens = side()
            rate = tokens / max(clock() - start, 1e-9)
            (ours_tps if side is ours else alone_tps).append(rate)
    return ours_tps, alone_tps


def compare_report(ours_tps: list[float], alone_tps: list[float], threads: int, load: float | None,
                   cpus: int) -> list[str]:
    """--compare's lines: the median of the pairs' ratios (xtokspec over the target alone) with its interquartile
    range and the tokens/s of the pair at the median (each side's own median would pair runs that were not timed
    together, and may point the other way), whether the ratio is resolved (the interquartile range on one side of
    1x), then a note where that range is wide (> WIDE_SPREAD of the median) and one where other work competes for
    the CPUs (the 1-minute load average when the command started plus this process's torch threads exceed the
    machine's CPUs by more than BUSY_MARGIN)."""
    pairs = sorted(zip(ours_tps, alone_tps, strict=True), key=lambda pair: pair[0] / pair[1])
    ratios = [o / a for o, a in pairs]
    median = statistics.median(ratios)
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (median,) * 3
    ours, alone = pairs[(len(pairs) - 1) // 2]
    lines = [f"xtokspec / the target alone: {median:.2f}x, the median of {len(ratios)} pairs of alternating runs "
             f"(IQR {low:.2f}-{high:.2f}x; the middle pair {ours:.1f} against {alone:.1f} tokens/s); {threads} "
             f"torch thread{'s' if threads != 1 else ''} both sides; neither side pays the process's first forwards "
             "(each side's first run is not timed)"]
    if low > 1 or high < 1:
        lines.append(f"xtokspec ran {'faster' if low > 1 else 'slower'} than the target alone in at least three "
                     "pairs out of four")
    else:
        lines.append("not resolved: the pairs' ratios fall on both sides of 1x")
    if (high - low) > WIDE_SPREAD * median:
        lines.append(f"note: the runs spread widely (IQR {(high - low) / median:.0%} of the median): read the "
                     "ratio as rough; --compare-runs takes more pairs")
    if load is not None and load + threads > cpus + BUSY_MARGIN:
        lines.append(f"note: the machine is busy: load average {load:.1f} before this command, plus {threads} torch "
                     f"thread{'s' if threads != 1 else ''} here, on {cpus} CPUs: the timings include waiting for them")
    return lines


def _compare(spec, prompt, kwargs: dict, text: str, runs: int, load: float | None) -> None:
    """--compare: the prompt through the target alone (transformers' generate, the same sampling settings) and
    through xtokspec again, alternating, in this process; prints the speed-up and, greedy, whether the target
    alone wrote the printed text."""
    import torch

    model, tokenizer = spec.target_model, spec.target_tokenizer
    if kwargs.get("messages"):
        inputs = tokenizer.apply_chat_template(kwargs["messages"], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
    else:
        inputs = tokenizer(prompt, return_tensors="pt")
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    params = spec.sampling_params(kwargs["do_sample"], kwargs["temperature"], kwargs["top_k"], kwargs["top_p"])
    options = dict(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p) \
        if params.do_sample else dict(do_sample=False)
    first_alone: list[list[int]] = []

    def alone() -> int:
        if kwargs.get("seed") is not None:
            torch.manual_seed(kwargs["seed"])
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=kwargs["max_new_tokens"], **options)
        ids = out[0, inputs["input_ids"].shape[1]:].tolist()
        first_alone.append(ids)
        return len(ids)

    def ours() -> int:
        return spec.generate(prompt, **kwargs).stats.new_tokens

    threads = torch.get_num_threads()  # NOTE: one process, so both sides run with these threads
    lines = compare_report(*time_sides(ours, alone, runs), threads, load, os.cpu_count() or 1)
    if not params.do_sample:
        same = tokenizer.decode(first_alone[0], skip_special_tokens=True, clean_up_tokenization_spaces=False) == text
        lines[0] += "; the same output" if same else "; outputs differ (a floating-point near-tie: see docs/how-it-works.md)"
    for line in lines:
        print(f"[xtokspec] {line}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xtokspec", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate", formatter_class=HelpFormatter,
        help="continue a prompt with speculative decoding (bundled fixture models by default)",
        description="Continue a prompt with speculative decoding; the output is the target's own (greedy: token "
        "for token; sampling: the same distribution). Prints the continuation, then the models and statistics "
        "on stderr.",
        epilog="example, with the bundled models (a tiny target: it writes sensible text on some prompts and "
        "loops on others): xtokspec generate 'dirp が相対パスで dirfd が特別な値' --compare",
    )
    gen.add_argument("prompt", nargs="?", default=None, help="text to continue; '-' reads it from stdin")
    gen.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file (for long prompts)")
    names = ", ".join(FIXTURE_NAMES)
    gen.add_argument("--target", default="ja-target",
                     help=f"target (large) model: a folder, a hub id, or a bundled name ({names})")
    gen.add_argument("--draft", default="ja-draft-bpe",
                     help=f"draft (small) model: a folder, a hub id, or a bundled name ({names})")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to add (target tokens)")
    gen.add_argument("--sample", action="store_true",
                     help="sample instead of greedy decoding (implied by --temperature > 0, --top-k, --top-p)")
    gen.add_argument("--temperature", type=float, default=None,
                     help="sampling temperature; 0 means greedy (default: the target's generation_config, else 1.0)")
    gen.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens; 0 disables "
                     "(default: the target's generation_config, else 50)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="nucleus sampling mass in (0, 1]; 1 disables (default: the target's generation_config, else 1.0)")
    gen.add_argument("--seed", type=int, default=None,
                     help="seed for sampling. With --keyed the same seed gives the same text whatever the draft "
                     "and the settings (the target alone's keyed sample). Without it, the same seed gives the same "
                     "output when the drafted cycles are the same, as with --fixed-k (fixed K, no fallback); with "
                     "adaptive K and the fallback, measured timings choose K and the target-alone cycles, so the "
                     "text can differ, while its distribution is always the target's")
    gen.add_argument("--keyed", action="store_true",
                     help="sample each position's token as a fixed function of --seed, the position and the "
                     "target's distribution (implies --sample): the text is the target alone's with that seed, "
                     "whatever is drafted (docs/how-it-works.md)")
    gen.add_argument("--proposal", choices=("auto", "onehot", "intersection"), default="auto",
                     help="how a cross-tokenizer draft proposes when sampling (see docs/how-it-works.md)")
    gen.add_argument("--num-draft-tokens", type=int, default=SpecConfig.num_draft_tokens,
                     help="draft tokens per cycle at the start (adaptive K changes it from measured costs)")
    gen.add_argument("--fixed-k", action="store_true", help="always draft --num-draft-tokens (no adaptive K)")
    gen.add_argument("--always-draft", action="store_true",
                     help="draft every cycle, even where the target alone is measured faster per token (by default "
                     "such cycles run the target alone, and drafting is probed now and then; see docs/how-it-works.md)")
    gen.add_argument("--no-healing", action="store_true",
                     help="no token healing: by default a cross-tokenizer draft chooses its last token of the text "
                     "again at each cycle start, and a longer token that starts with it may replace it (greedy "
                     "chains and one-hot cycles; see docs/how-it-works.md)")
    gen.add_argument("--tree-width", type=int, default=SpecConfig.tree_width, metavar="M",
                     help="token trees: drafted candidates kept at each depth, verified in one target call "
                     "(1: a single chain)")
    gen.add_argument("--tree-root", choices=TREE_ROOTS, default=SpecConfig.tree_root,
                     help="sampled trees: the root's candidates drawn from the draft and tested against its "
                     "distribution (sampled), or its likeliest ones tested one-hot (top); greedy trees take the top")
    gen.add_argument("--cache", choices=("auto", "dynamic", "static"), default=SpecConfig.cache,
                     help="KV cache backend for both models; auto = static on CUDA, dynamic elsewhere")
    gen.add_argument("--compile", nargs="?", type=compile_choice, const=True, default=SpecConfig.compile,
                     metavar="{auto,graphs,inductor,off}",
                     help="how both models' short forwards run: auto (the default) records them as CUDA graphs on a "
                     "GPU where the models allow it and runs them eagerly elsewhere; graphs; inductor (torch.compile, "
                     "minutes to compile on a GPU; a bare --compile means this); off (eager). See docs/gpu.md")
    gen.add_argument("--dtype", choices=DTYPES, default="auto",
                     help="weights' dtype for both models; auto = the checkpoint's own, as transformers and the "
                     "Python API load it (bfloat16 for the bundled models)")
    gen.add_argument("--cpu-linears", choices=CPU_LINEARS, default="torch",
                     help="onednn: both models' linears packed for oneDNN (float32 on the CPU): shorter verification "
                     "forwards on CPUs without bfloat16 units; the output is the converted target's (docs/how-it-works.md)")
    gen.add_argument("--target-device", default=None, help="e.g. cuda:0, or auto (accelerate device_map)")
    gen.add_argument("--draft-device", default=None, help="e.g. cpu or cuda:0")
    gen.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                     help="trim the draft's output head to N ids, the most frequent in --calibration (a cheaper "
                     "draft step for large-vocabulary drafts; the output is unchanged; see docs/how-it-works.md)")
    gen.add_argument("--calibration", default=None, metavar="FILE",
                     help="UTF-8 text in the domain you will generate, one document per line (for --draft-vocab)")
    gen.add_argument("--stream", action="store_true", help="print text as soon as it is verified")
    gen.add_argument("--compare", action="store_true",
                     help="also time the target alone (transformers' generate) against xtokspec on the prompt, "
                     "alternating, after an untimed first run of each, and print the median speed-up with its spread "
                     "(and, greedy, whether the outputs are the same)")
    gen.add_argument("--compare-runs", type=int, default=5, metavar="N",
                     help="--compare: timed runs of each side")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as one user message through the target's chat template")
    gen.set_defaults(func=_generate)

    add_bench_parser(sub)
    _document_bench(sub.choices["bench"])
    add_distill_parser(sub, HelpFormatter)
    return parser


_BENCH_HELP = {  # the help of the bench options that bench.add_bench_parser leaves without one
    "preset": "the models: fixtures (the bundled ja-target with ja-draft-same and ja-draft-bpe) or real "
    "(Qwen2.5-Coder-1.5B with Qwen2.5-Coder-0.5B, Gemma-3-270M and SmolLM2-135M drafts, fetched and converted "
    "beforehand by benchmarks/real_models.py from an xtokspec checkout)",
    "modes": "decoding modes, each run on every prompt: greedy, or T=<temperature> to sample at that temperature "
    "(top-k and top-p from the target's generation_config); e.g. --modes greedy T=0.7 T=1.0",
    "prompts": "how many prompts: the first N of the preset's (fixtures/data/prompts.txt, or the real preset's 6)",
    "max_new_tokens": "most tokens each system adds to each prompt (target tokens)",
    "dtype": "weights' dtype for every model",
    "out": "folder of the report: OUT/PRESET/results.json, table.md, the speedup plots and manifest.json (commit, "
    "machine, versions, command, date)",
    "no_progress": "no progress bar",
}


def _bench_mode(text: str) -> str:
    """A --modes value: 'greedy' or 'T=<temperature>' with a temperature > 0."""
    try:
        if text == "greedy" or (text.startswith("T=") and float(text.removeprefix("T=")) > 0):
            return text
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text!r}: a mode is greedy or T=<temperature> with a temperature > 0 (e.g. T=0.7)")


def _document_bench(bench: argparse.ArgumentParser) -> None:
    """`xtokspec bench --help`: a description, help on every option, the defaults shown."""
    bench.formatter_class = HelpFormatter
    bench.description = (
        "Benchmark xtokspec against the target alone and transformers' assisted generation on a preset's models: "
        "every system on every prompt and mode, interleaved prompt by prompt after a warm-up, the target's and "
        "the draft's forward calls counted. Writes OUT/PRESET/results.json, table.md and plots, and prints the table."
    )
    for action in bench._actions:
        if not action.help and action.dest in _BENCH_HELP:
            action.help = _BENCH_HELP[action.dest]
        if action.dest == "modes":
            action.type, action.metavar = _bench_mode, "MODE"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except XTokSpecError as err:
        print(f"xtokspec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
