"""`steps.py` with the policy's view at each xtokspec call (a diagnostic, cd060f5's proposer): besides what
`steps.py` records, each call's entry ends with what the measured arms of its batch size held (target-alone
samples, their median with the call before, drafting's decayed tokens and seconds, its measured steps, whether
drafting loses there) and what the cost model predicted for it (a step without proposals, with one and with two
per request, a draft forward over all of them, a call without drafts, the pooled acceptance). `steps-arms.json`
as `steps.json`, the call entries with that pair appended; the printout in `steps-arms-output.txt`.

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-queued/steps_arms.py   (env as vllm_bench.py's, one core)
"""

import collections
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import vllm_bench as vb  # noqa: E402

for key, value in vb.ENV.items():
    os.environ.setdefault(key, value)

from xtokspec.vllm.proposer import TextBridgeProposer  # noqa: E402


def report(log: list) -> None:
    steps = [record for record in log if record[0] == "xtokspec"]
    alone = [record for record in log if record[0] == "alone"]
    print("steps alone", len(alone), f"{sum(r[2] for r in alone):.2f} s", "| x", len(steps),
          f"{sum(r[2] for r in steps):.2f} s")
    kinds = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0])
    for _, _, seconds, call in steps:
        kind = (call[3] if call else "none") + ("/probe" if call and call[7] else "")
        entry = kinds[kind]
        entry[0] += 1
        entry[1] += seconds
        if call:
            entry[2] += call[2]
            entry[3] += call[4]
            entry[4] += call[1]
    for kind, (count, seconds, call, draft, ids) in kinds.items():
        print(f"{kind:16s} steps {count:4d} step s {seconds:.2f} call s {call:.3f} draft s {draft:.3f} ids {ids}")
    print("reading chunks", sum(r[3][5] for r in steps if r[3]), "new states", sum(r[3][6] for r in steps if r[3]))


def extra(p, rows):
    m = p.measured.get(rows)
    meas = None if m is None else (len(m.alone), (sorted(m.alone)[len(m.alone)//2] if m.alone else None),
                                   m.drafting.tokens, m.drafting.seconds, m.drafting.cycles, m.drafting_loses(rows))
    try:
        model = (p.step_cost(rows, 0), p.step_cost(rows, rows), p.step_cost(rows, 2*rows), p.draft(rows), p.quiet(rows),
                 p.pool.rate(0.5, 0.0))
    except Exception as e:
        model = repr(e)
    return meas, model


def main() -> None:
    chosen = vb.preset("fixtures", 3)
    both = vb.load_prompts("fixtures", 40)
    prompts, warm = both[:32], both[32:]
    engines = {name: vb.build_engine(chosen, name, 8, prompts[0], log_stats=False) for name in ("alone", "xtokspec")}
    for name in engines:
        vb.run_batches(engines[name][0], [warm], 64)
    vb.run_lockstep(engines, prompts, 64, running=4)
    log, last = [], {}
    propose = TextBridgeProposer._propose

    def recorded(self, sampled, *args, **kwargs):
        stats = self.stats
        before = stats.draft_s, stats.prefill_chunks, stats.new_states
        t0 = time.perf_counter()
        out = propose(self, sampled, *args, **kwargs)
        last["call"] = (len(out), sum(map(len, out)), time.perf_counter() - t0, self.policy.chose,
                        stats.draft_s - before[0], stats.prefill_chunks - before[1], stats.new_states - before[2],
                        self.policy.probed, extra(self.policy, len(out)))
        return out

    TextBridgeProposer._propose = recorded
    for name, (llm, _) in engines.items():
        engine = llm.llm_engine

        def timed(engine=engine, step=engine.step, name=name):
            rows = engine.get_num_unfinished_requests()
            last.pop("call", None)
            t0 = time.perf_counter()
            out = step()
            log.append((name, rows, time.perf_counter() - t0, last.get("call")))
            return out

        engine.step = timed
    for n in range(2):
        result = vb.run_lockstep(engines, prompts, 64, running=8)
        log.append(("round", n, result["alone"][0], result["xtokspec"][0]))
        print("pass", n, f"x/a {result['alone'][0] / result['xtokspec'][0]:.3f}", flush=True)
    (HERE / "steps-arms.json").write_text(json.dumps(log), encoding="utf-8")
    report(log)


if __name__ == "__main__":
    main()
