"""Where greedy drafting goes at batch 8 on the fixture pair: one round of `vllm_bench.py` (alone, xtokspec; batches
1, 4, 8 as in this folder's run, 32 prompts x 64 tokens, lockstep) with the row policy (`decode.rows.RowDraftLengths`)
logging each call that drafted. Prints, for each batch of 8 prompts (the cold start's first): its drafting calls by
the requests left in the step, the per-token rates drafted at (the policy's, learned from the proposals counted in
`evidence`), the ids proposed and accepted (and how many the policy's rates predicted). Run from the repository
root, as vllm_bench.py (its environment):

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-excess/tails.py > output-tails.txt
"""

import atexit
import collections
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

from xtokspec.decode import rows as policy_rows  # noqa: E402
from xtokspec.types import expected_tokens  # noqa: E402

# per batch of prompts added: its size, [(requests left, rates drafted at, evidence)], proposed, accepted, and the
# accepted ids the policy's rates predicted
batches = []
lengths, observe_proposal = policy_rows.RowDraftLengths.lengths, policy_rows.RowDraftLengths.observe_proposal
last_rows = [0]


def logged_lengths(self, requests, rows, *args, **kwargs):
    out = lengths(self, requests, rows, *args, **kwargs)
    if rows > last_rows[0]:  # a batch of prompts has just been added
        batches.append([rows, [], 0, 0, 0.0])
    last_rows[0] = rows
    if batches and any(out):
        rates = self.rates(requests)
        batches[-1][1].append((rows, [rates[i] for i, x in enumerate(out) if x],
                               [requests[i].successes + requests[i].failures for i, x in enumerate(out) if x]))
        batches[-1][4] += sum(expected_tokens(rates[i], x) - 1 for i, x in enumerate(out) if x)
    return out


def logged_proposal(self, request, proposed, new):
    accepted = observe_proposal(self, request, proposed, new)
    if batches and proposed and new:
        batches[-1][2] += len(proposed)
        batches[-1][3] += accepted
    return accepted


def report() -> None:
    eights = [b[1:] for b in batches if b[0] == 8]
    for n, (calls, proposed, accepted, predicted) in enumerate(eights):
        by = collections.Counter(rows for rows, _, _ in calls)
        rates = [r for _, rs, _ in calls for r in rs]
        evidence = [e for _, _, es in calls for e in es]
        print(f"batch of 8 #{n}{' (cold start)' if n == 0 else ''}: {len(calls)} drafting calls, by requests left "
              f"{dict(sorted(by.items(), reverse=True))}; rates drafted at "
              + (f"median {statistics.median(rates):.2f} ({min(rates):.2f}-{max(rates):.2f}), evidence median "
                 f"{statistics.median(evidence):.1f} proposals" if rates else "-")
              + f"; {proposed} ids proposed, {accepted} accepted ({predicted:.0f} predicted)")


policy_rows.RowDraftLengths.lengths, policy_rows.RowDraftLengths.observe_proposal = logged_lengths, logged_proposal
atexit.register(report)
if __name__ == "__main__":
    import vllm_bench

    sys.argv[1:] = ["--preset", "fixtures", "--systems", "alone,xtokspec", "--rounds", "1", "--batches", "1,4,8",
                    "--prompts", "32", "--new-tokens", "64", "--lockstep"]
    vllm_bench.main()
