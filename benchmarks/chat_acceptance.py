"""Acceptance of chat requests against the same requests as plain prompts, per draft.

Each request is the start of a held-out Japanese paragraph (fixtures/data/heldout.txt; technical manuals). As a
plain prompt it is that text, continued as it stands; as a chat request it is one user turn asking for the
text's continuation (`--instruction`, then the text), given to `generate(messages=...)`, which renders the
target's chat template (and its default system prompt, if any) and shows the draft the same text without the
target's special tokens it does not have. Greedy, every cycle drafting (`SpecConfig(fallback=False)`; with
`--k N` also a fixed draft length), one process, one torch thread by default.

Per draft, form and request it records the per-token acceptance alpha (`GenerationStats.token_acceptance`), the
target tokens committed per target call, the drafted and accepted counts, the mean draft length and why
generation stopped; with `--check` (the default) also whether the output equals the target alone's greedy
`generate` token for token (in bfloat16 a divergence can be a floating-point near-tie). Pooled figures: alpha =
all accepted / (all accepted + all rejections), tokens per call = all committed tokens / all target calls.
Results: results.json and results.md under --out.

    python benchmarks/chat_acceptance.py --out benchmarks/results/epyc-avx512bf16/chat

Model names are those of benchmarks/real_models.py (converted under xtokspec.cli.presets.real_models_root()).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import cpu_name, load_real, write_manifest

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "次の文章の続きを書いてください。\n\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="the target (an instruct model with a chat template)")
    parser.add_argument("--drafts", nargs="+", default=["same-qwen=qwen2.5-coder-0.5b", "bridged-gemma=gemma-3-270m"],
                        help="LABEL=NAME pairs: the drafts to measure")
    parser.add_argument("--requests", type=int, default=8, help="how many held-out paragraphs")
    parser.add_argument("--chars", type=int, default=40, help="characters of each paragraph in the request")
    parser.add_argument("--new-tokens", type=int, default=64, help="most target tokens per request")
    parser.add_argument("--instruction", default=INSTRUCTION, help="the chat turn's words before the text")
    parser.add_argument("--k", type=int, default=None,
                        help="a fixed draft length (adaptive=False); by default the adaptive one, which follows measured costs")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare each output with the target alone's greedy generate")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "local" / "chat")
    return parser


def requests(count: int, chars: int) -> list[str]:
    """The first `chars` characters of `count` held-out paragraphs spread evenly over the file (each at least
    twice that long, so that the text has a continuation to find)."""
    lines = (ROOT / "fixtures" / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()
    long_enough = [line for line in lines if len(line) >= 2 * chars]
    step = len(long_enough) // count
    return [long_enough[i * step][:chars] for i in range(count)]


def target_alone(model, tokenizer, text: str, new_tokens: int) -> list[int]:
    inputs = tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def divergence(model, tokenizer, text: str, got: list[int], want: list[int]) -> dict | None:
    """Where the output first differs from the target alone's, with the target's logit margin there between the
    two tokens (one plain forward over the prompt and the common prefix): a floating-point near-tie or a bug."""
    n = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if n is None:
        return None
    ids = tokenizer(text)["input_ids"] + want[:n]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    return {"position": n, "margin": abs(float(logits[got[n]] - logits[want[n]]))}


def pooled(rows: list[dict]) -> dict:
    accepted = sum(r["accepted"] for r in rows)
    rejections = sum(r["rejections"] for r in rows)
    alphas = [r["token_acceptance"] for r in rows]
    return {"alpha": accepted / (accepted + rejections) if accepted + rejections else 0.0,
            "tokens_per_call": sum(r["new_tokens"] for r in rows) / sum(r["target_forwards"] for r in rows),
            "alpha_min": min(alphas), "alpha_median": statistics.median(alphas), "alpha_max": max(alphas),
            "mean_draft_length": sum(sum(r["draft_lengths"]) for r in rows) / sum(len(r["draft_lengths"]) for r in rows),
            "new_tokens": sum(r["new_tokens"] for r in rows),
            "identical": sum(r["identical"] is True for r in rows) if rows[0]["identical"] is not None else None,
            "requests": len(rows), "margins": [r["divergence"]["margin"] for r in rows if r.get("divergence")]}


def table(results: dict) -> str:
    lines = ["| draft | form | per-token alpha (pooled) | alpha per request (min / median / max) | tokens per target call "
             "| mean draft length | new tokens | identical to the target alone |",
             "|---|---|---|---|---|---|---|---|"]
    for label, forms in results["pooled"].items():
        for form, p in forms.items():
            same = "not checked" if p["identical"] is None else f"{p['identical']} of {p['requests']}"
            if p.get("margins"):
                same += " (others: margins " + ", ".join(f"{m:.3f}" for m in p["margins"]) + ")"
            lines.append(f"| {label} | {form} | {p['alpha']:.3f} | {p['alpha_min']:.2f} / {p['alpha_median']:.2f} / "
                         f"{p['alpha_max']:.2f} | {p['tokens_per_call']:.2f} | {p['mean_draft_length']:.1f} | "
                         f"{p['new_tokens']} | {same} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from xtokspec import SpecConfig, XTokSpec

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = (SpecConfig(fallback=False) if args.k is None
              else SpecConfig(fallback=False, adaptive=False, num_draft_tokens=args.k, max_draft_tokens=max(args.k, 12)))
    target = load_real(args.target, dtype)
    texts = requests(args.requests, args.chars)
    forms = {"plain": [{"prompt": t} for t in texts],
             "chat": [{"messages": [{"role": "user", "content": args.instruction + t}]} for t in texts]}
    tokenizer = target[1]
    rendered = {form: [call.get("prompt") or tokenizer.apply_chat_template(call["messages"], tokenize=False,
                                                                          add_generation_prompt=True) for call in calls]
                for form, calls in forms.items()}
    reference = {}
    if args.check:
        for form in forms:
            reference[form] = [target_alone(target[0], tokenizer, text, args.new_tokens) for text in rendered[form]]
        print(f"target alone: {sum(map(len, reference['plain']))} plain and {sum(map(len, reference['chat']))} chat tokens",
              file=sys.stderr, flush=True)
    rows, summary = [], {}
    for pair in args.drafts:
        label, name = pair.split("=", 1)
        spec = XTokSpec(target, load_real(name, dtype), config=config)
        summary[label] = {}
        for form, calls in forms.items():
            form_rows = []
            for i, call in enumerate(calls):
                start = time.perf_counter()
                result = spec.generate(**call, max_new_tokens=args.new_tokens)
                stats = result.stats
                row = {"draft": label, "draft_model": name, "form": form, "request": i, "text_in": texts[i],
                       "output": result.text, "stop_reason": result.stop_reason, "seconds": time.perf_counter() - start,
                       "new_tokens": stats.new_tokens, "target_forwards": stats.target_forwards,
                       "drafted": stats.drafted, "accepted": stats.accepted, "rejections": stats.rejections,
                       "token_acceptance": stats.token_acceptance, "tokens_per_call": stats.tokens_per_cycle,
                       "draft_lengths": list(stats.draft_lengths), "token_ids": result.token_ids,
                       "identical": (result.token_ids == reference[form][i]) if args.check else None}
                if args.check and not row["identical"]:
                    row["target_alone_ids"] = reference[form][i]
                    row["divergence"] = divergence(target[0], tokenizer, rendered[form][i], result.token_ids,
                                                   reference[form][i])
                form_rows.append(row)
                print(f"{label} {form} {i}: alpha {row['token_acceptance']:.2f}, {row['tokens_per_call']:.2f} tokens/call, "
                      f"{row['new_tokens']} tokens ({row['stop_reason']}), identical {row['identical']}"
                      + (f" (token {d['position']}, margin {d['margin']:.3f})" if (d := row.get("divergence")) else ""),
                      file=sys.stderr, flush=True)
            rows += form_rows
            summary[label][form] = pooled(form_rows)
        del spec
    results = {"command": "python " + " ".join([f"benchmarks/{Path(__file__).name}", *(argv or sys.argv[1:])]),
               "hardware": f"{cpu_name()}, {torch.get_num_threads()} torch thread(s)",
               "torch": torch.__version__, "dtype": args.dtype, "config": repr(config),
               "target": args.target, "instruction": args.instruction, "pooled": summary, "runs": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_manifest(args.out)
    (args.out / "results.json").write_text(json.dumps(results, ensure_ascii=False, indent=1), encoding="utf-8")
    md = f"{table(results)}\n\n`{results['command']}`; {results['hardware']}, torch {results['torch']}, {args.dtype}.\n"
    (args.out / "results.md").write_text(md, encoding="utf-8")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
