"""Why batched forwards over captured (static) caches cost SmolLM2-135M's shape 3x what they cost over dynamic
caches on an H200 (a diagnostic): for B waiting requests, `draft_together` over dynamic caches and over the
static caches that captured drafts keep, each under torch.profiler; prints both ways' wall time and the host
calls that differ most (counts and self CPU time), and the CUDA synchronisations.

    python benchmarks/results/h200/proposer-ways/profile_copy.py [--device cuda] [--batches 1 4] > OUT.txt
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from batch_draft_cost import build, sync, waiting  # noqa: E402

from xtokspec.decode.propose import ChainProposer  # noqa: E402
from xtokspec.runtime.compile import GraphedStep  # noqa: E402
from xtokspec.vllm.batch import draft_together  # noqa: E402


def table(prof) -> dict[str, tuple[int, float]]:
    return {e.key: (e.count, e.self_cpu_time_total / 1e3, getattr(e, "self_device_time_total", 0) / 1e3)
            for e in prof.key_averages()}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--draft", default="smollm2")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--no-cudnn-sdp", action="store_true", help="torch.backends.cuda.enable_cudnn_sdp(False)")
    args = parser.parse_args()
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = build(args.draft, args.device, dtype)
    step = GraphedStep(model, "draft") if args.device.startswith("cuda") else None
    if step is not None:
        step.KEPT_CACHES = max(args.batches)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    for batch in args.batches:
        pool: list = []
        if step is not None:  # every step length recorded first, as batch_draft_cost.py does
            prompt = [rng.randrange(3, vocab) for _ in range(400)]
            for tail in range(1, 5):
                states = waiting(model, [prompt] * batch, [tail] * batch, step, pool)
                for s in states:
                    ChainProposer(set())._draft_greedy_on_device(s, 3)
                pool = [s.kv for s in states]
        ways = ["dynamic"] + (["static"] if step is not None else [])
        tables, walls = {}, {way: [] for way in ways}
        for rep in range(4):
            prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(200, 400))] for _ in range(batch)]
            tails = [rng.randint(1, 4) for _ in range(batch)]
            for way in ways if rep % 2 else ways[::-1]:  # the way that meets a shape first pays its one-time costs
                states = waiting(model, prompts, tails, step if way == "static" else None, pool)
                sync(args.device)
                activities = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
                with torch.profiler.profile(activities=activities) if rep == 3 else _Null() as prof:
                    t0 = time.perf_counter()
                    draft_together(model, states, 3, set())
                    sync(args.device)
                    walls[way].append(time.perf_counter() - t0)
                if rep == 3:
                    tables[way] = table(prof)
                if way == "static":
                    pool = [s.kv for s in states]
        print(f"== {args.draft} B={batch}: " + ", ".join(
            f"{way} {1e3 * min(walls[way][1:3]):.1f} ms (unprofiled, best of reps 1-2)" for way in ways), flush=True)
        if "static" not in tables:
            tables["static"] = tables["dynamic"]
        keys = set(tables["dynamic"]) | set(tables["static"])
        rows = []
        for key in keys:
            cd, td, gd = tables["dynamic"].get(key, (0, 0.0, 0.0))
            cs, ts, gs = tables["static"].get(key, (0, 0.0, 0.0))
            rows.append((max(ts - td, gs - gd), key, cd, cs, td, ts, gd, gs))
        rows.sort(reverse=True)
        print(f"{'call':60s} {'calls dyn':>9s} {'calls st':>9s} {'cpu ms dyn':>10s} {'cpu ms st':>10s} "
              f"{'dev ms dyn':>10s} {'dev ms st':>10s}")
        for _, key, cd, cs, td, ts, gd, gs in rows[:30]:
            print(f"{key[:60]:60s} {cd:9d} {cs:9d} {td:10.2f} {ts:10.2f} {gd:10.2f} {gs:10.2f}")
        for way in ways:
            total = tables[way]
            print(f"  {way}: host calls {sum(v[0] for v in total.values())}, self cpu {sum(v[1] for v in total.values()):.1f} ms, "
                  f"self device {sum(v[2] for v in total.values()):.1f} ms")
        for key in sorted(keys):
            if "ynchronize" in key or "Memcpy" in key or "LaunchKernel" in key:
                print("  sync/copy:", key, tables["dynamic"].get(key), tables["static"].get(key))


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
