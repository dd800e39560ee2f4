"""GPU per-call costs at the shapes of a 13B and a 7B target with their drafts, and the speedups they predict.

No real weights reach the GPU machine, and a forward's time does not depend on the weights' values, so the
models are built there with random bf16 weights and the published shapes:

    13b:   target llm-jp-13b-v1.0 (GPT-2 style: 40 layers, hidden 5120, 40 heads, vocabulary 50,570)
           draft  open-calm-small (GPT-NeoX: 12 layers, hidden 768, 12 heads, vocabulary 52,096)
    7b-1b: target a Llama-2-7B shape (32 layers, hidden 4096, 32 heads, MLP 11008, vocabulary 32,000)
           draft  a TinyLlama-1.1B shape (22 layers, hidden 2048, 32 heads / 4 KV heads, MLP 5632, 32,000)

Measured per pair, at a CONTEXT-token context, median of REPS after warm-up (torch.cuda.synchronize around
each call): the target's one-token step; verification of m = 1..16 tokens (eager, and padded to xtokspec's
compile buckets through torch.compile); the draft's one-token step eager (dynamic cache), on the static
cache, and compiled (CUDA graphs: torch.compile mode reduce-overhead), i.e. c = draft step / target step.

Prediction (labelled as such): the acceptance traces that `xtokspec bench --preset real` measured on the CPU
(benchmarks/results/fast-bf16-cpu/real/results.json: per-token acceptance alpha and each cycle's proposals m)
combined with these GPU costs by Leviathan et al.'s eq. 1: tokens per cycle (1 - alpha^(m+1)) / (1 - alpha) over
the cycle's cost (its draft steps * draft step + verify(m) + the loop's own overhead), in units of a target step.

Run on the GPU machine:  python benchmarks/gpu.py --out "$OUT"        (about 4 minutes on an H100)
Smoke test on a CPU:     python benchmarks/gpu.py --tiny --out /tmp/gpu-smoke
Writes gpu.json and gpu.md to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REAL_TRACES = ROOT / "benchmarks" / "results" / "fast-bf16-cpu" / "real" / "results.json"  # the real preset's run
sys.path.insert(0, str(ROOT))
from common import write_manifest  # noqa: E402

from xtokspec.runtime.cache import ModelState  # noqa: E402
from xtokspec.runtime.compile import COMPILE_BUCKETS, CompiledStep, move_positions, padded_length  # noqa: E402
from xtokspec.runtime.kv import to_device  # noqa: E402
from xtokspec.types import expected_tokens  # noqa: E402

CONTEXT = 512
REPS = 20
VERIFY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16)
COMPILED_LENGTHS = (1, 2, 4, 8)  # one compiled bucket each
TREE_ROWS = (8, 16, 32)  # compiled tree-masked verifications: the last id and 7, 15, 31 trie nodes


def shapes(tiny: bool) -> dict[str, tuple]:
    """pair name -> (target config, draft config); --tiny divides widths and depths for a CPU smoke test."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    def s(n: int, div: int) -> int:
        return max(2, n // div) if tiny else n

    w, d = 32, 8  # tiny: width / 32, depth / 8
    return {
        "13b": (
            GPT2Config(n_layer=s(40, d), n_embd=s(5120, w), n_head=s(40, w), vocab_size=50570, n_positions=2048),
            GPTNeoXConfig(num_hidden_layers=s(12, d), hidden_size=s(768, w), num_attention_heads=s(12, w),
                          intermediate_size=s(3072, w), vocab_size=52096, max_position_embeddings=2048),
        ),
        "7b-1b": (
            LlamaConfig(num_hidden_layers=s(32, d), hidden_size=s(4096, w), num_attention_heads=s(32, w),
                        num_key_value_heads=s(32, w), intermediate_size=s(11008, w), vocab_size=32000,
                        max_position_embeddings=4096),
            LlamaConfig(num_hidden_layers=s(22, d), hidden_size=s(2048, w), num_attention_heads=s(32, w),
                        num_key_value_heads=max(1, s(4, w)), intermediate_size=s(5632, w), vocab_size=32000,
                        max_position_embeddings=4096),
        ),
    }


def build(config, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of fn() over reps calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def per_call_costs(model, device: str, reps: int, compiled: bool, backend: str,
                   lengths: tuple[int, ...] = VERIFY_LENGTHS) -> dict[int, float]:
    """m -> seconds of a forward over m new ids after a CONTEXT-token context (rolled back after each call)."""
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (CONTEXT + 32,)).tolist()
    # NOTE: static, the buffer holds buffer_capacity(576) = 768 positions, the size a 512-token prompt with 64 new
    # tokens gets in use (the stored 13B and 7B/1B eager static figures had a buffer of exactly 576)
    state = ModelState(model, ids[:CONTEXT], backend, CONTEXT + 64, CompiledStep(model) if compiled else None)
    state.forward(keep=1)  # the context
    costs = {}
    for m in lengths:
        def call(m=m):
            state.ids.extend(ids[CONTEXT : CONTEXT + m])
            state.forward(keep=m)
            state.truncate(CONTEXT)
        costs[m] = timed(call, device, reps)
    return costs


@torch.inference_mode()
def tree_costs(model, device: str, reps: int, rows: tuple[int, ...] = TREE_ROWS) -> dict[int, float]:
    """rows -> seconds of a compiled tree-masked verification (`forward_tree`, as a tree cycle runs it) of the
    last id and rows - 1 trie nodes, 4 children per node, after a CONTEXT-token context; dropped after each call:
    how much of a captured tree cycle's extra cost over a chain's is the target's verification."""
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (CONTEXT + rows[-1],)).tolist()
    state = ModelState(model, ids[:CONTEXT], "static", CONTEXT + 64, CompiledStep(model, "target"),
                       tree_nodes=rows[-1] - 1)
    state.forward(keep=1)  # the context
    costs = {}
    for n in rows:
        tokens = [0] + ids[CONTEXT : CONTEXT + n - 1]  # node 0: the last id, already there
        parents = [-1] + [(i - 1) // 4 for i in range(1, n)]

        def call(tokens=tokens, parents=parents):
            state.forward_tree(tokens, parents)
            state.keep_path([], tokens)

        costs[n] = timed(call, device, reps)
    return costs


@torch.inference_mode()
def move_costs(model, device: str, reps: int) -> dict[str, float]:
    """Seconds of keep_path's move of an accepted path that is off the first branch (4 positions; here onto
    themselves) in a CONTEXT-token static cache: eagerly two kernels per layer tensor, captured one replay."""
    ids = torch.randint(model.config.vocab_size, (CONTEXT,)).tolist()
    state = ModelState(model, ids, "static", CONTEXT + 64, CompiledStep(model, "target"))
    state.forward(keep=1)
    tensors = [t for pair in state.kv.layer_tensors() for t in pair]
    index = to_device(list(range(CONTEXT - 4, CONTEXT)), torch.device(device))
    return {"target_move_eager": timed(lambda: [move_positions([t], index, index) for t in tensors], device, reps),
            "target_move_compiled": timed(lambda: state.step.move_positions(tensors, index, index), device, reps)}


def measure_pair(name: str, target_config, draft_config, device: str, reps: int) -> dict:
    dtype = torch.bfloat16
    out = {"pair": name}
    for role, config in (("target", target_config), ("draft", draft_config)):
        model = build(config, device, dtype)
        out[f"{role}_params"] = sum(p.numel() for p in model.parameters())
        # compiling costs ~30 s per bucket at the 13B shape: the draft needs its one-token step and a width-4 tree
        # level (4 rows), the target the buckets of typical verifications
        lengths = COMPILED_LENGTHS if role == "target" else (1, 4)
        out[f"{role}_eager"] = per_call_costs(model, device, reps, compiled=False, backend="dynamic")
        out[f"{role}_static"] = per_call_costs(model, device, reps, compiled=False, backend="static")
        out[f"{role}_compiled"] = per_call_costs(model, device, reps, compiled=True, backend="static", lengths=lengths)
        if role == "target":
            out["target_tree_compiled"] = tree_costs(model, device, reps)
            out |= move_costs(model, device, reps)
        print(f"{name} {role}: {out[f'{role}_params'] / 1e9:.2f} B params; 1-token step eager "
              f"{out[f'{role}_eager'][1] * 1e3:.2f} ms, compiled {out[f'{role}_compiled'][1] * 1e3:.2f} ms", flush=True)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    step = out["target_eager"][1]
    out["c_eager"] = out["draft_eager"][1] / step
    out["c_compiled"] = out["draft_compiled"][1] / out["target_compiled"][1]
    out["verify8_over_step"] = out["target_compiled"][8] / out["target_compiled"][1]
    return out


def verify_cost(costs: dict, m: int) -> float:
    """Linear interpolation of the measured verification costs at m proposals (+1 for the bonus row); beyond
    the longest measured, the line through the last two, never below the longest measured cost (a noisy
    last pair can slope down: compiled at the 13B shapes, 12.17 ms at 4 rows and 11.99 ms at 8)."""
    xs = sorted(costs)
    n = max(m + 1, xs[0])
    if n > xs[-1] and len(xs) > 1:
        a, b = xs[-2], xs[-1]
        return max(costs[b], costs[b] + (costs[b] - costs[a]) * (n - b) / (b - a))
    n = min(n, xs[-1])
    lo = max(x for x in xs if x <= n)
    hi = min(x for x in xs if x >= n)
    return costs[lo] if lo == hi else costs[lo] + (costs[hi] - costs[lo]) * (n - lo) / (hi - lo)


def padded(rows: int) -> int:
    """The length a compiled call over `rows` ids runs at: the next bucket (longer ones run eagerly)."""
    return padded_length(rows) or rows


def measured_at_most(costs: dict, n: int) -> float:
    """The cost measured at n ids, or at the longest measured length below n."""
    return costs[max(k for k in costs if k <= n)]


def predict(pair: dict, results: Path, overhead_s: float, costs: str = "compiled",
            tree_overhead_s: float | None = None) -> list[dict]:
    """PREDICTION: speedups of the real pairs' CPU acceptance traces at this pair's GPU costs: "compiled" (CUDA
    graphs, over the compiled target step) or "static" (eager on the static cache, CUDA's default, over the
    eager target step).

    Token-tree runs (proposal "... tree", width from the system's "treeN"): tokens per cycle as measured (eq. 1
    is for chains); each draft forward at the cost of a draft call over `width` ids (a tree level: the level's
    nodes on the draft's own cache, `ModelState.grow_tree`), and each verification at the target's cost for
    its nodes plus one id. Both run through the compiled steps with compile=True, padded to the buckets, so
    "compiled" costs them at their buckets' compiled costs: the target's tree-masked verification as measured
    (`target_tree_compiled`, 8, 16 and 32 rows) where the costs file has it. ASSUMED where not measured: a
    tree-masked call costs what a causal call of the same length does (the same shapes, an explicit mask instead
    of one built inside), and, where a length was not measured compiled (the draft's 4 rows in older costs
    files), it costs what the longest shorter measured one does."""
    if not results.is_file():
        return []
    runs = json.loads(results.read_text())["runs"]
    verify = pair[f"target_{costs}"]
    step = verify[1]
    draft_step = pair[f"draft_{costs}"][1]
    measured_trees = pair.get("target_tree_compiled", {}) if costs == "compiled" else {}

    def tree_verify(m: int) -> float:  # m nodes and the id before them; tree-masked where that was measured
        return measured_trees.get(m + 1) or verify_cost(verify, m)

    tree_overhead_s = overhead_s if tree_overhead_s is None else tree_overhead_s
    rows: dict[tuple, list[float]] = {}
    for run in runs:
        stats = run.get("stats") or {}
        if not stats.get("target_forwards") or not stats.get("proposal_lengths"):
            continue
        alpha = min(stats["token_acceptance"], 0.999)
        cycles = stats["target_forwards"]
        steps_per_cycle = stats["draft_forwards"] / cycles
        lengths = stats["proposal_lengths"]
        if str(stats.get("proposal", "")).endswith(" tree"):
            tokens = stats["new_tokens"] / cycles
            width = int(re.search(r"tree(\d+)", run["system"]).group(1))
            level = measured_at_most(pair[f"draft_{costs}"], padded(width) if costs == "compiled" else width)
            nodes = [padded(m + 1) - 1 if costs == "compiled" else m for m in lengths]
            cost = steps_per_cycle * level + sum(tree_verify(m) for m in nodes) / cycles
            rows.setdefault((run["system"], run["mode"]), []).append(tokens / ((cost + tree_overhead_s) / step))
            continue
        tokens = sum(expected_tokens(alpha, m) for m in lengths) / cycles
        cost = steps_per_cycle * draft_step + sum(verify_cost(verify, m) for m in lengths) / cycles
        rows.setdefault((run["system"], run["mode"]), []).append(tokens / ((cost + overhead_s) / step))
    return [{"system": s, "mode": m, "predicted_speedup": statistics.median(v), "prompts": len(v)}
            for (s, m), v in sorted(rows.items())]


def markdown(meta: dict, pairs: list[dict], predictions: dict) -> str:
    ms = lambda s: f"{s * 1e3:.2f}"  # noqa: E731
    lines = [f"GPU: {meta['device_name']}; torch {meta['torch']}, transformers {meta['transformers']}; bf16, "
             f"random weights, {CONTEXT}-token context, median of {meta['reps']}.", "",
             "| pair | target step ms (eager / compiled) | draft step ms (eager / static / compiled) | c eager | "
             "c compiled | verify 8 / step |", "|---|---|---|---|---|---|"]
    for p in pairs:
        lines.append(f"| {p['pair']} | {ms(p['target_eager'][1])} / {ms(p['target_compiled'][1])} | "
                     f"{ms(p['draft_eager'][1])} / {ms(p['draft_static'][1])} / {ms(p['draft_compiled'][1])} | "
                     f"{p['c_eager']:.3f} | {p['c_compiled']:.3f} | {p['verify8_over_step']:.2f} |")
    lines += ["", "Verification cost (ms, compiled) by proposals m: "]
    for p in pairs:
        lines.append(f"- {p['pair']}: " + ", ".join(f"m={m} {ms(v)}" for m, v in p["target_compiled"].items()))
    for p in pairs:
        if p.get("target_tree_compiled"):
            lines.append(f"- {p['pair']}, tree-masked (rows = the last id + nodes): "
                         + ", ".join(f"{n} rows {ms(v)}" for n, v in p["target_tree_compiled"].items()))
        if "target_move_eager" in p:
            lines.append(f"- {p['pair']}, keep_path's move of 4 positions: eager {ms(p['target_move_eager'])}, "
                         f"compiled {ms(p['target_move_compiled'])}")
    lines += ["", "**Predicted** speedups over the target alone (CPU acceptance traces of the real preset x these GPU "
              "costs; not measured), both models compiled, or both eager on the static cache (CUDA's default):",
              "", "| pair | system | mode | predicted, compiled | predicted, eager |", "|---|---|---|---|---|"]
    for pair, rows in predictions.items():
        eager = lambda r: f"{r['predicted_eager']:.2f}x" if r.get("predicted_eager") == r.get("predicted_eager") else "–"  # noqa: E731
        lines += [f"| {pair} | {r['system']} | {r['mode']} | {r['predicted_speedup']:.2f}x | {eager(r)} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gpu.json and gpu.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="shrunken shapes (a smoke test on a CPU)")
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--pairs", nargs="+", default=["13b", "7b-1b"])
    parser.add_argument("--overhead-ms", type=float, default=None,
                        help="the loop's own cost per cycle (bridge, syncs, Python); default: 0 (left out)")
    parser.add_argument("--tree-overhead-ms", type=float, default=None,
                        help="the same for a token tree's cycle (beam, branch bridging, trie); default: --overhead-ms")
    parser.add_argument("--traces", type=Path, default=REAL_TRACES,
                        help="the CPU acceptance traces to predict from (an `xtokspec bench` results.json)")
    parser.add_argument("--costs", type=Path, default=None,
                        help="predict from the pairs of a stored gpu.json instead of measuring (any machine)")
    args = parser.parse_args()
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_manifest(out, args.device)
    meta = {"device": args.device, "torch": torch.__version__, "transformers": transformers.__version__,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "reps": args.reps, "tiny": args.tiny, "buckets": COMPILE_BUCKETS}
    overhead = (args.overhead_ms or 0.0) / 1e3
    tree_overhead = overhead if args.tree_overhead_ms is None else args.tree_overhead_ms / 1e3
    pairs, predictions = [], {}
    stored = {}
    if args.costs:
        stored_json = json.loads(args.costs.read_text())
        meta = stored_json["meta"] | {"costs_from": str(args.costs)}
        stored = {p["pair"]: p for p in stored_json["pairs"]}
    meta |= {"traces": str(args.traces), "overhead_ms": overhead * 1e3, "tree_overhead_ms": tree_overhead * 1e3}
    for name in ([n for n in args.pairs if n in stored] if args.costs else args.pairs):
        # written after each pair, so that a run stopped at its time limit keeps the first
        pair = stored.get(name) or measure_pair(name, *shapes(args.tiny)[name], args.device, args.reps)
        pairs.append({k: ({int(m): v for m, v in c.items()} if isinstance(c, dict) else c) for k, c in pair.items()})
        eager = {(r["system"], r["mode"]): r["predicted_speedup"]
                 for r in predict(pairs[-1], args.traces, overhead, "static", tree_overhead)}
        predictions[name] = [r | {"predicted_eager": eager.get((r["system"], r["mode"]), float("nan"))}
                             for r in predict(pairs[-1], args.traces, overhead, tree_overhead_s=tree_overhead)]
        (out / "gpu.json").write_text(json.dumps({"meta": meta, "pairs": pairs, "predictions": predictions}, indent=1))
        (out / "gpu.md").write_text(markdown(meta, pairs, predictions))
    print((out / "gpu.md").read_text())


if __name__ == "__main__":
    main()
