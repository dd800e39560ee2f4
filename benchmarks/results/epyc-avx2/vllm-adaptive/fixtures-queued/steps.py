"""Where a queue at 8 running goes (a diagnostic, d8de769's proposer): the target alone and xtokspec in lockstep,
the cold start and a queue at 4 running served first as vllm_bench.py --queued does, then every prompt queued at
8 running, twice; every engine step timed, and for xtokspec what its call chose, its seconds, the draft's
seconds in it (its reading of a request's text included), the ids it proposed. Prints each pass's ratio and the
steps by what was chosen (`steps.json`: [engine, requests, seconds, [rows, ids, call s, chose, draft s, reading
chunks, new states, probed] or None], and [round, pass, alone's seconds, xtokspec's]; the printout in
`steps-output.txt`).

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-queued/steps.py   (env as vllm_bench.py's, one core)
"""

import collections
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[4]
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


def main(view=None, name: str = "steps.json") -> None:
    """`view(policy, rows)`: more of the policy's state appended to each call's entry (`steps_arms.py`)."""
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
                        self.policy.probed) + ((view(self.policy, len(out)),) if view else ())
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
    (HERE / name).write_text(json.dumps(log), encoding="utf-8")
    report(log)


if __name__ == "__main__":
    main()
