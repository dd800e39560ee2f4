"""CUDA graphs without inductor (SpecConfig(compile="graphs"), the default on a GPU) at the mission pairs' shapes:
what recording costs and what a recorded step costs, beside eager steps and (from a stored gpu.json) inductor's.

Models as in gpu.py (random bf16 weights, the published shapes; `--pairs 13b 7b-1b`). Per pair and model, over a
CONTEXT-token context on the static cache, through `ModelState` as the loop runs them:
- the one-id step and verifications of m = 1, 2, 4, 8 ids eager, and replayed from their CUDA graphs
  (`compile.GraphedStep`), median of REPS after warm-up; c = draft step / target step for each;
- the seconds each shape took to record (two warm-up forwards and the capture) at its first call.
**Predicted** speedups (labelled as such) from the real pairs' CPU acceptance traces, as gpu.py predicts them, with
the graphs' costs standing in for the compiled ones.

`--first-generate` measures instead, in this (fresh) process, what a user's first `generate` costs with the default
configuration at the 13B shapes (random weights, the fixture tokenizers as in gpu_loop.py): the time to its first
streamed text, its whole wall time and its `stats.capture_seconds`, then the same for a second generation.

    python benchmarks/gpu_graphs.py --out "$OUT/graphs"                       # on the GPU machine
    python benchmarks/gpu_graphs.py --first-generate --out "$OUT/first"       # a fresh process per run
    python benchmarks/gpu_graphs.py --tiny --device cpu --out /tmp/graphs     # smoke test (eager: no graphs there)
Writes graphs.json and graphs.md (or first.json) to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_manifest  # noqa: E402
from gpu import CONTEXT, REAL_TRACES, REPS, build, predict, shapes, sync, timed  # noqa: E402

from xtokspec.runtime.cache import ModelState  # noqa: E402
from xtokspec.runtime.compile import GraphedStep  # noqa: E402

LENGTHS = (1, 2, 4, 8)


@torch.inference_mode()
def costs(model, device: str, reps: int, graphs: bool, role: str) -> tuple[dict[int, float], dict[int, float]]:
    """m -> seconds of a forward over m new ids after a CONTEXT-token context (rolled back after each call), and
    m -> seconds its first call took (with graphs: the recording)."""
    ids = torch.randint(model.config.vocab_size, (CONTEXT + 32,)).tolist()
    step = GraphedStep(model, role) if graphs and device.startswith("cuda") else None
    state = ModelState(model, ids[:CONTEXT], "static", CONTEXT + 64, step)
    state.forward(keep=1)  # the context (eager: a cache's first forward always is)
    out, first = {}, {}
    for m in LENGTHS:
        def call(m=m):
            state.ids.extend(ids[CONTEXT : CONTEXT + m])
            state.forward(keep=m)
            state.truncate(CONTEXT)

        sync(device)
        start = time.perf_counter()
        call()
        sync(device)
        first[m] = time.perf_counter() - start
        out[m] = timed(call, device, reps)
    return out, first


def measure_pair(name: str, target_config, draft_config, device: str, reps: int) -> dict:
    out = {"pair": name}
    for role, config in (("target", target_config), ("draft", draft_config)):
        model = build(config, device, torch.bfloat16)
        out[f"{role}_static"], _ = costs(model, device, reps, False, role)
        out[f"{role}_graphs"], out[f"{role}_graphs_first"] = costs(model, device, reps, True, role)
        ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
        print(f"{name} {role}: 1-id step eager {ms(out[f'{role}_static'][1])} ms, graphs "
              f"{ms(out[f'{role}_graphs'][1])} ms; first calls (recording) "
              + ", ".join(f"m={m} {s:.2f} s" for m, s in out[f"{role}_graphs_first"].items()), flush=True)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    out["c_static"] = out["draft_static"][1] / out["target_static"][1]
    out["c_graphs"] = out["draft_graphs"][1] / out["target_graphs"][1]
    out["verify8_over_step_graphs"] = out["target_graphs"][8] / out["target_graphs"][1]
    out["recording_s"] = sum(out["target_graphs_first"].values()) + sum(out["draft_graphs_first"].values())
    return out


def markdown(meta: dict, pairs: list[dict], predictions: dict) -> str:
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = [f"GPU: {meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}; bf16, random "
             f"weights, {CONTEXT}-token context on the static cache, median of {meta['reps']}.", "",
             "| pair | target step ms (eager / graphs) | draft step ms (eager / graphs) | c eager | c graphs | "
             "verify 8 / step (graphs) | recording 8 shapes, s |", "|---|---|---|---|---|---|---|"]
    for p in pairs:
        lines.append(f"| {p['pair']} | {ms(p['target_static'][1])} / {ms(p['target_graphs'][1])} | "
                     f"{ms(p['draft_static'][1])} / {ms(p['draft_graphs'][1])} | {p['c_static']:.3f} | "
                     f"{p['c_graphs']:.3f} | {p['verify8_over_step_graphs']:.2f} | {p['recording_s']:.2f} |")
    lines += ["", "First call of each shape with graphs (its recording included), s:"]
    for p in pairs:
        for role in ("target", "draft"):
            lines.append(f"- {p['pair']} {role}: " + ", ".join(f"m={m} {s:.2f}"
                                                              for m, s in p[f"{role}_graphs_first"].items()))
    lines += ["", "**Predicted** speedups over the target alone (CPU acceptance traces of the real preset x these GPU "
              "costs; not measured), both models' steps replayed from CUDA graphs:", "",
              "| pair | system | mode | predicted, graphs |", "|---|---|---|---|"]
    for pair, rows in predictions.items():
        lines += [f"| {pair} | {r['system']} | {r['mode']} | {r['predicted_speedup']:.2f}x |" for r in rows]
    return "\n".join(lines) + "\n"


def first_generate(args) -> None:
    """A first and a second `generate` with the default configuration at the 13B shapes, in this process."""
    from gpu_loop import PROMPTS, no_eos, tokenizer, with_vocab

    from xtokspec import XTokSpec
    from xtokspec.types import GenerationStats

    target_config, draft_config = shapes(args.tiny)["13b"]
    sp, bpe = tokenizer("ja-target"), tokenizer("ja-draft-bpe")
    torch.manual_seed(0)
    target = build(with_vocab(target_config, len(sp)), args.device, torch.bfloat16)
    draft = build(with_vocab(draft_config, len(bpe)), args.device, torch.bfloat16)
    no_eos(target, sp)
    no_eos(draft, bpe)
    spec = XTokSpec((target, sp), (draft, bpe))  # the default configuration
    rows = []
    for run in ("first", "second"):
        stats = GenerationStats()
        sync(args.device)
        start = time.perf_counter()
        first_text = None
        for _ in spec.stream(PROMPTS[1], max_new_tokens=args.tokens, stats=stats):
            if first_text is None:
                first_text = time.perf_counter() - start
        sync(args.device)
        rows.append({"run": run, "first_text_s": first_text, "wall_s": time.perf_counter() - start,
                     "capture_s": stats.capture_seconds, "tokens": stats.new_tokens, "cache": stats.cache})
        print(rows[-1], flush=True)
    meta = {"device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "tokens": args.tokens, "tiny": args.tiny}
    (Path(args.out) / "first.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="shrunken shapes (a smoke test on a CPU)")
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--pairs", nargs="+", default=["13b", "7b-1b"])
    parser.add_argument("--traces", type=Path, default=REAL_TRACES,
                        help="the CPU acceptance traces to predict from (an `xtokspec bench` results.json)")
    parser.add_argument("--overhead-ms", type=float, default=0.0, help="the loop's own cost per cycle")
    parser.add_argument("--first-generate", action="store_true", help="a user's first and second generate instead")
    parser.add_argument("--tokens", type=int, default=32, help="--first-generate: new tokens per generation")
    args = parser.parse_args()
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, args.device)
    if args.first_generate:
        first_generate(args)
        return
    meta = {"device": args.device, "torch": torch.__version__, "transformers": transformers.__version__,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "reps": args.reps, "tiny": args.tiny, "traces": str(args.traces), "overhead_ms": args.overhead_ms}
    pairs, predictions = [], {}
    for name in args.pairs:
        pair = measure_pair(name, *shapes(args.tiny)[name], args.device, args.reps)
        pairs.append(pair)
        # gpu.py's prediction over the graphs' costs (padded to the buckets, as its "compiled" costs are)
        as_compiled = pair | {"target_compiled": pair["target_graphs"], "draft_compiled": pair["draft_graphs"]}
        predictions[name] = predict(as_compiled, args.traces, args.overhead_ms / 1e3)
        (out / "graphs.json").write_text(json.dumps({"meta": meta, "pairs": pairs, "predictions": predictions},
                                                    indent=1))
        (out / "graphs.md").write_text(markdown(meta, pairs, predictions))
    print((out / "graphs.md").read_text())


if __name__ == "__main__":
    main()
