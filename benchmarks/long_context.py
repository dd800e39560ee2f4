"""Long prompts: speed against the target alone, time to first text, and the caches' memory, by prompt length.

For each prompt length (target tokens cut from fixtures/data/heldout.txt, the held-out Japanese text) and each
number of new tokens, in one process and paired per prompt:
- the target alone: transformers' greedy `generate`, timed whole; its time to first token is one forward over the
  prompt (its prefill) and the argmax, the median of three;
- each xtokspec system, `XTokSpec(target, draft)` with the default settings (greedy; the fallback on, so the first
  cycle runs the target alone and the draft prefills its prompt in the second): `XTokSpec.cycles`, what
  `generate` and `stream` run on, timed to its first committed token and to the end, its token ids checked
  against the target's own (a divergence is reported with the target's logit margin there);
- the memory of both caches at the end of the generation: the bytes of every key and value tensor they hold.
`--draft-contexts` repeats each system with `SpecConfig(draft_context=n)` (the draft's window of the text, which
also caps what it prefills of a long prompt). Results: results.json and results.md under --out.

    python benchmarks/long_context.py --lengths 256 1024 4096 --new-tokens 32 256 --out benchmarks/results/xeon-amx/long-context/real
    python benchmarks/long_context.py --target gemma-3-270m --drafts bridged-qwen=qwen2.5-coder-0.5b --lengths 1024 4096

Model names are those of benchmarks/real_models.py (converted under xtokspec.cli.presets.real_models_root()).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import cpu_name, load_real, write_manifest

ROOT = Path(__file__).resolve().parents[1]


def prompt_of_length(tokenizer, text: str, length: int) -> str:
    """The first `length` target tokens of `text` as text (cut where the tokens decode to whole characters)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length:
        raise SystemExit(f"the held-out text has only {len(ids)} tokens; asked for {length}")
    cut = tokenizer.decode(ids[:length])
    return cut.rstrip("\ufffd")


def cache_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for pair in state.kv.layer_tensors() for t in pair)


def target_alone(model, tokenizer, prompt: str, new_tokens: int) -> dict:
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        prefills = []
        for _ in range(3):  # the median of three: one prefill is a few seconds, at the mercy of the machine's load
            start = time.perf_counter()
            first = int(model(**inputs).logits[0, -1].argmax())
            prefills.append(time.perf_counter() - start)
        ttft = statistics.median(prefills)
        start = time.perf_counter()
        out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens)
        seconds = time.perf_counter() - start
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert ids[0] == first
    return {"ids": ids, "ttft_s": ttft, "seconds": seconds, "tokens_per_s": len(ids) / seconds}


def system(spec, prompt: str, new_tokens: int) -> dict:
    """One generation through `XTokSpec.cycles` (what `generate` and `stream` run on): the time to its first
    committed token, the whole time, the ids, and both caches' bytes when the generation hands them back."""
    from xtokspec import GenerationStats

    sizes = {}
    release = spec.kept.release

    def measured_release(state, keep=1):  # NOTE: a benchmark's hook: the caches' bytes when they are handed back
        sizes["target" if state.model is spec.target_model else "draft"] = cache_bytes(state)
        release(state, keep)

    spec.kept.release = measured_release
    stats = GenerationStats()
    ids: list[int] = []
    try:
        start = time.perf_counter()
        target_ids = spec.target_tokenizer(prompt)["input_ids"]
        draft_ids = spec.draft_prompt_ids(target_ids)
        first = None
        for new_ids in spec.cycles(target_ids, draft_ids, new_tokens, stats, spec.sampling_params()):
            if first is None:
                first = time.perf_counter() - start
            ids += new_ids
        seconds = time.perf_counter() - start
    finally:
        spec.kept.release = release
    return {"ids": ids, "ttft_s": first, "seconds": seconds, "tokens_per_s": stats.new_tokens / seconds,
            "new_tokens": stats.new_tokens, "tokens_per_call": stats.tokens_per_cycle,
            "token_acceptance": stats.token_acceptance, "alone_cycles": stats.alone_cycles,
            "target_calls": stats.target_forwards, "stop_reason": stats.stop_reason,
            "target_cache_mb": sizes.get("target", 0) / 2**20, "draft_cache_mb": sizes.get("draft", 0) / 2**20}


def divergence(model, tokenizer, prompt: str, got: list[int], want: list[int]) -> dict | None:
    """Where two greedy outputs first differ, with the target's logit margin there between the two tokens (one
    plain forward over the prompt and the common prefix): a floating-point near-tie or a bug."""
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if n is None:
        return None
    ids = tokenizer(prompt)["input_ids"] + want[:n]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return {"position": n, "margin": abs(float(logits[got[n]] - logits[want[n]])),
            "logit": float(logits[want[n]])}


def equal(result: dict) -> str:
    d = result.get("divergence")
    return "yes" if result["equal"] else f"no: token {d['position']}, margin {d['margin']:.3f}" if d else "no"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="the target model's name")
    parser.add_argument("--drafts", nargs="+", default=["bridged-gemma=gemma-3-270m", "same-qwen=qwen2.5-coder-0.5b"],
                        help="drafts as LABEL=NAME")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096], help="prompt lengths (target tokens)")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[32, 256], help="new tokens per generation")
    parser.add_argument("--draft-contexts", type=int, nargs="*", default=[],
                        help="also run each system with SpecConfig(draft_context=n) for each n")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "long-context", help="where results go")
    args = parser.parse_args()

    from xtokspec import SpecConfig, XTokSpec

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = load_real(args.target, dtype)
    drafts = {label: load_real(name, dtype) for label, name in (d.split("=", 1) for d in args.drafts)}
    configs = [(None, SpecConfig())] + [(n, SpecConfig(draft_context=n)) for n in args.draft_contexts]
    specs = {(label, n): XTokSpec(target, draft, config=config) for label, draft in drafts.items() for n, config in configs}
    text = (ROOT / "fixtures" / "data" / "heldout.txt").read_text(encoding="utf-8")
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} threads, {args.dtype}; target {args.target}")
    for spec in specs.values():  # warm-up: token maps and first calls
        spec.generate("東京", max_new_tokens=4)
    rows = []
    for length in args.lengths:
        prompt = prompt_of_length(target[1], text, length)
        for new_tokens in args.new_tokens:
            alone = target_alone(*target, prompt, new_tokens)
            row = {"length": length, "new_tokens": new_tokens,
                   "alone": {k: v for k, v in alone.items() if k not in ("ids", "text")}}
            rows.append(row)
            print(f"L={length} N={new_tokens}: target alone {alone['tokens_per_s']:.2f} tok/s, first token {alone['ttft_s']:.2f} s")
            for (label, window), spec in specs.items():
                result = system(spec, prompt, new_tokens)
                n = min(len(result["ids"]), len(alone["ids"]))
                result["equal"] = result["ids"][:n] == alone["ids"][:n]  # greedy: the target's own ids
                if not result["equal"]:
                    result["divergence"] = divergence(*target, prompt, result["ids"], alone["ids"])
                result["speedup"] = alone["seconds"] / result["seconds"] * result["new_tokens"] / len(alone["ids"])
                result["ttft_ratio"] = result["ttft_s"] / alone["ttft_s"] if result["ttft_s"] else None
                name = label + (f" window {window}" if window else "")
                row[name] = {k: v for k, v in result.items() if k != "ids"}
                print(f"  {name}: {result['tokens_per_s']:.2f} tok/s = {result['speedup']:.2f}x, first token "
                      f"{result['ttft_s']:.2f} s ({result['ttft_ratio']:.2f}x the target's), {result['tokens_per_call']:.2f} "
                      f"tokens/call, caches {result['target_cache_mb']:.0f} + {result['draft_cache_mb']:.0f} MiB, "
                      f"equal {result['equal']} {result.get('divergence') or ''}")
                write(args, rows)  # after every system: a long run stopped midway keeps what it measured
    print(f"wrote {args.out}/results.md")


def write(args, rows: list[dict]) -> None:
    """results.json and results.md in `args.out`, for the rows measured so far."""
    args.out.mkdir(parents=True, exist_ok=True)
    write_manifest(args.out)
    meta = {"cpu": cpu_name(), "threads": args.threads, "dtype": args.dtype, "target": args.target,
            "drafts": args.drafts, "torch": torch.__version__}
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, ensure_ascii=False))
    lines = [f"# Long prompts: {args.target}, {args.dtype}, {cpu_name()}, {args.threads} threads", "",
             "| prompt | new | system | tok/s | vs target alone | first token s | vs target's first token | tokens/call | "
             "target cache MiB | draft cache MiB | equal |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        alone = row["alone"]
        lines.append(f"| {row['length']} | {row['new_tokens']} | target alone | {alone['tokens_per_s']:.2f} | 1.00 | "
                     f"{alone['ttft_s']:.2f} | 1.00 | 1.00 | | | |")
        for name, r in row.items():
            if isinstance(r, dict) and name != "alone":
                lines.append(f"| {row['length']} | {row['new_tokens']} | {name} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f} | "
                             f"{r['ttft_s']:.2f} | {r['ttft_ratio']:.2f} | {r['tokens_per_call']:.2f} | "
                             f"{r['target_cache_mb']:.0f} | {r['draft_cache_mb']:.0f} | {equal(r)} |")
    speedups = [r["speedup"] for row in rows for name, r in row.items() if isinstance(r, dict) and name != "alone"]
    if speedups:
        lines += ["", f"median speed-up over all rows: {statistics.median(speedups):.2f}"]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
