"""What the proposer's presence costs where it drafts nothing: the real target in float32, alone against a second
engine (vllm_bench.py's `null`, or the proposer with SmolLM2-135M whose policy never drafts: `--quiet`), both
built in one process, stepped in turn over each batch of prompts as `vllm_bench.py --lockstep` steps them, each
engine step timed; then (unless `--no-generate`) the same prompts through each engine's `generate`, in turn.
`--gc`: every garbage collection that ran during an engine's step, by generation (`output.txt` has the runs).

    python benchmarks/results/epyc-avx2/vllm-adaptive/real-f32-trim/quiet/quiet_steps.py alone null [--prompts 8] [--batches 1,8]
    python benchmarks/results/epyc-avx2/vllm-adaptive/real-f32-trim/quiet/quiet_steps.py alone xtokspec_smollm2 --quiet --no-generate [--gc]
    (env as vllm_bench.py's, one core)
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[5]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import vllm_bench as vb  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("systems", nargs=2, help="two of vllm_bench.py's real systems, alone first")
    parser.add_argument("--quiet", action="store_true", help="xtokspec's policy never drafts")
    parser.add_argument("--no-generate", action="store_true")
    parser.add_argument("--gc", action="store_true")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8])
    parser.add_argument("--steps-out", type=Path, help="each engine step's seconds at the last batch size (json)")
    args = parser.parse_args()
    if args.quiet:
        from xtokspec.decode.rows import RowDraftLengths

        RowDraftLengths.lengths = lambda self, requests, rows, *a, **k: self._alone(len(requests), requests)
    from vllm import LLM, SamplingParams

    preset = vb.preset("real", 3)
    prompts = [line for line in (ROOT / "fixtures" / "data" / "heldout.txt").read_text().splitlines() if line.strip()]
    base = dict(model=preset["target"], dtype="float32", max_model_len=512, max_num_seqs=8, enforce_eager=True)
    names = args.systems
    engines = {name: LLM(**base, **preset["systems"][name]) for name in names}
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    for llm in engines.values():
        llm.generate(prompts[:8], greedy, use_tqdm=False)  # the cold start: a first batch on each engine
    steps = {name: [] for name in names}
    stepping, collections, started = [None], {name: [] for name in names}, [0.0]

    def collected(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif stepping[0] is not None:
            collections[stepping[0]].append((info["generation"], time.perf_counter() - started[0]))

    if args.gc:
        gc.callbacks.append(collected)
    for name, llm in engines.items():
        engine, step = llm.llm_engine, llm.llm_engine.step

        def timed(step=step, name=name):
            stepping[0], t0 = name, time.perf_counter()
            out = step()
            steps[name].append(time.perf_counter() - t0)
            stepping[0] = None
            return out

        engine.step = timed
    for size in args.batches:
        for name in names:
            steps[name].clear()
        total = dict.fromkeys(names, 0.0)
        for i in range(0, args.prompts, size):
            batch = prompts[8 + i: 8 + i + size]
            order = names if (i // size) % 2 == 0 else names[::-1]
            out = vb.run_lockstep({name: (engines[name], []) for name in order}, batch, 32)
            for name in names:
                total[name] += out[name][0]
        print(size, {name: dict(total=round(total[name], 3), steps=len(steps[name]),
                                median_ms=round(1e3 * statistics.median(steps[name]), 2),
                                mean_ms=round(1e3 * statistics.mean(steps[name]), 2)) for name in names}, flush=True)
        if args.no_generate:
            continue
        took = dict.fromkeys(names, 0.0)
        for i in range(0, args.prompts, size):
            batch = prompts[8 + i: 8 + i + size]
            for name in names if (i // size) % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                engines[name].generate(batch, greedy, use_tqdm=False)
                took[name] += time.perf_counter() - t0
        print(size, "generate", {name: round(seconds, 3) for name, seconds in took.items()}, flush=True)
    if args.steps_out:
        args.steps_out.write_text(json.dumps(steps))
    for name in names if args.gc else ():
        runs = collections[name]
        print(name, "gc runs", len(runs), "by generation", {g: sum(1 for x in runs if x[0] == g) for g in (0, 1, 2)},
              "seconds", round(sum(x[1] for x in runs), 3), flush=True)


if __name__ == "__main__":
    main()
