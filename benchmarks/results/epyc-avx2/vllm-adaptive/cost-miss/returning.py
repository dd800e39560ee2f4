"""Predicted against realized extra tokens of drafting calls, by whether the requests that drafted had text to read
(new requests, and those that had stopped: what they committed while they did not draft) or went on drafting, from
a policy log written by `b8-steps/steps_why.py` (default: the Xeon's fixture log,
`xeon-avx512bf16/vllm-adaptive/cost-miss/why/`).
A call's extra tokens: those committed beyond one per request; predicted from each drafting request's rate and
length (`expected_tokens`), realized from the step that verified the call.

    python benchmarks/results/epyc-avx2/vllm-adaptive/cost-miss/returning.py [LOG] > output-returning.txt
"""

import collections
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT))

from xtokspec.types import expected_tokens  # noqa: E402

DEFAULT = ROOT / "benchmarks/results/xeon-avx512bf16/vllm-adaptive/cost-miss/why/why.json.gz"


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT
    log = json.load(gzip.open(path, "rt"))
    calls = []
    for event in log:
        kind = event.get("ev")
        if kind is None:
            calls.append({"choice": event})
        elif kind == "step" and calls:
            calls[-1].setdefault("tokens", event["t"])  # the step that verified this call's proposals
    by = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for call in calls:
        choice, tokens = call["choice"], call.get("tokens")
        if choice.get("chose") != "drafting" or "a" not in choice or tokens is None:
            continue
        rows = max(choice["rows"], choice["n"])
        drafting = [(a, x, u) for a, x, u in zip(choice["a"], choice["out"], choice["unread"], strict=True) if x]
        stopped = sum(u > 0 for _, _, u in drafting)
        kind = "went on" if not stopped else "had text to read" if stopped == len(drafting) else "mixed"
        size = "1" if rows == 1 else "2-5" if rows <= 5 else "6-8"
        total = by[size, kind]
        total[0] += 1
        total[1] += sum(expected_tokens(a, x) - 1 for a, x, _ in drafting)
        total[2] += tokens - rows
    print(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    for (size, kind), (n, predicted, realized) in sorted(by.items()):
        print(f"{size} requests, drafting requests {kind}: {n} calls, extra tokens a call predicted "
              f"{predicted / n:.2f}, realized {realized / n:.2f}")


if __name__ == "__main__":
    main()
