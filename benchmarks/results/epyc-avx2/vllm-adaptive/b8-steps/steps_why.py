"""Why the proposer drafts or not at each call, and whether its model's predictions came true (a diagnostic,
0fad9a2's proposer): the fixture pair on one engine with xtokspec's proposer, batch 1 and 4 served as
vllm_bench.py does, then batch 8 twice. Each policy call is logged with the requests' rates, the fitted costs,
each request's reading charge, whether the bound `may_pay` let it be costed, the model's best rate over the
target alone's, and the measured arms at that size (`drafting_loses`; `cost_miss` where the policy has it); each step and call with their seconds
(`why.json.gz`). `summary()` pairs each call's choice with its call's seconds and the next step's, by requests in a
step: predicted against realized seconds and tokens for drafting calls, the fitted step against the realized one
for quiet calls (`output-why.txt`).

    python benchmarks/results/epyc-avx2/vllm-adaptive/b8-steps/steps_why.py [--real] [--out DIR]   (env as vllm_bench.py's, one core)

`--out DIR`: write the log and summary into DIR instead of this folder (another machine's results).
"""

import collections
import gzip
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)

from xtokspec.decode.measures import UNMEASURED  # noqa: E402
from xtokspec.decode.rows import RowDraftLengths  # noqa: E402
from xtokspec.types import expected_tokens  # noqa: E402


def record(log: list) -> None:
    """Wrap the policy's choice and observations to append to `log`."""
    lengths, step, time_ = RowDraftLengths.lengths, RowDraftLengths.observe_step, RowDraftLengths.observe_time

    def chosen(self, requests, rows, ways=("batched",), full=True):
        n, info = len(requests), {}
        info["qc"] = self.costs.quiet(max(rows, n))
        if self.adaptive and n and self.steps >= 4 and self.costs.drafted >= 4:
            r = max(rows, n)
            a, base = self.rates(requests), self.costs.step(r, 0)
            slowest, start = not full and r > 1, [self.startup(q) for q in requests]
            best_rate, alone, best_cost = 0.0, r / max(base, 1e-9), base
            for k in range(1, self.cap + 1):
                out = self.costs.slowest_at(k, a, r, base, ways, start) if slowest else \
                    self.costs.best_at(k, a, r, base, alone, ways, start)
                if out[1] > best_rate:
                    best_rate, best_cost = out[1], out[2]
            measured = self.measured.get(r, UNMEASURED)
            info.update(a=[round(x, 3) for x in a], base=base * 1e3, cost=best_cost * 1e3,
                        start=[round(s * 1e3, 2) for s in start], unread=[q.unread for q in requests],
                        pays=self.costs.may_pay(a, r, base, ways, slowest), model=round(best_rate / alone, 3),
                        loses=measured.drafting_loses(r),
                        miss=round(measured.cost_miss(), 3) if hasattr(measured, "cost_miss") else None)
        out = lengths(self, requests, rows, ways, full)
        log.append(dict(rows=rows, n=n, out=out, chose=self.chose, probed=self.probed, **info))
        return out

    def stepped(self, rows, proposals, seconds, tokens=None):
        log.append(dict(ev="step", rows=rows, p=proposals, s=seconds, t=tokens))
        return step(self, rows, proposals, seconds, tokens)

    def timed(self, rows, interval, call):
        log.append(dict(ev="time", rows=rows, i=interval, c=call))
        return time_(self, rows, interval, call)

    RowDraftLengths.lengths, RowDraftLengths.observe_step, RowDraftLengths.observe_time = chosen, stepped, timed


def summary(log: list) -> list[str]:
    """Each choice with its call's seconds and the next step's (and its committed tokens), by requests in a step."""
    calls, current = [], None
    for event in log:
        kind = event.get("ev")
        if kind is None:
            current = dict(choice=event)
            calls.append(current)
        elif kind == "time" and current is not None:
            current["call"], current["before"] = event["c"], event["i"]
        elif kind == "step" and calls:
            calls[-1]["tokens_before"] = event["t"]
    for this, after in zip(calls, calls[1:], strict=False):
        this["step"], this["tokens"] = after.get("before"), after.get("tokens_before")
    by = collections.defaultdict(list)
    for call in calls:
        choice = call["choice"]
        if "cost" not in choice or call.get("step") is None or call.get("call") is None:
            continue
        rows = max(choice["rows"], choice["n"])
        real = (call["step"] + call["call"] - choice["qc"]) * 1e3
        if any(choice["out"]) and choice["chose"] == "drafting":
            tokens = rows - choice["n"] + sum(expected_tokens(a, x) for a, x in zip(choice["a"], choice["out"],
                                                                                      strict=True))
            by["drafting", rows].append((choice["cost"], real, tokens, call["tokens"], choice["base"],
                                         choice["model"]))
        elif not any(choice["out"]):
            by["quiet", rows].append((choice["base"], real))
    lines = []
    for (kind, rows), values in sorted(by.items()):
        mean = lambda i, v=values: statistics.mean(x[i] for x in v if x[i] is not None)  # noqa: E731
        if kind == "drafting":
            real = (mean(3) / mean(1)) / (rows / mean(4))
            lines.append(f"drafting, {rows} requests: {len(values)} calls, predicted {mean(0):.1f} ms, realized "
                         f"{mean(1):.1f} ms; tokens predicted {mean(2):.2f}, realized {mean(3):.2f}; the model's "
                         f"ratio to the target alone {mean(5):.3f}, realized {real:.3f}")
        else:
            lines.append(f"quiet, {rows} requests: {len(values)} calls, fitted step {mean(0):.1f} ms, realized "
                         f"{mean(1):.1f} ms")
    return lines


def main() -> None:
    """`--real`: the real pair instead (float32, the trimmed Gemma-3-270M for Qwen2.5-Coder-1.5B, 8 prompts x 32
    tokens, batch 1, 4 and 8 once each, as vllm_bench.py's `real-f32-trim/` runs; `why-real.json.gz`,
    `output-why-real.txt`)."""
    real = "--real" in sys.argv[1:]
    out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv[1:] else HERE
    out.mkdir(parents=True, exist_ok=True)
    log: list = []
    record(log)
    chosen = vb.preset("real" if real else "fixtures", 3)
    count, tokens, system = (8, 32, "xtokspec_gemma_trim") if real else (32, 64, "xtokspec")
    if real:
        chosen["dtype"] = "float32"
    both = vb.load_prompts("real" if real else "fixtures", count + 8)
    prompts, warm = both[:count], both[count:]
    if real:
        vb.held_out(chosen, set(both), Path(tempfile.mkdtemp()))
    llm, _ = vb.build_engine(chosen, system, 8, prompts[0], log_stats=False)
    vb.run_batches(llm, [warm], tokens)
    for batch in (1, 4, 8) if real else (1, 4, 8, 8):
        log.append(dict(ev="batch", size=batch))
        vb.run_batches(llm, [prompts[i : i + batch] for i in range(0, count, batch)], tokens)
    name = "-real" if real else ""
    with gzip.open(out / f"why{name}.json.gz", "wt", encoding="utf-8") as f:
        json.dump(log, f)
    lines = summary(log)
    (out / f"output-why{name}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
