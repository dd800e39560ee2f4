"""Each policy call at one batch size of a `steps_why.py` log, one line each: the requests, the lengths chosen, the
choice ("drafting", "alone", "cold", "probe"; P: a probe), each request's rate, the model's best rate over the target
alone's, whether the measured arms at that size say drafting loses in tokens per second, the measured cost miss
there (where the log has it), each request's unread ids and reading charge (ms).

    python benchmarks/results/xeon-avx512bf16/vllm-adaptive/why/calls.py why-real.json.gz [--batch 1]
"""

import gzip
import json
import sys
from pathlib import Path


def main() -> None:
    path = Path(sys.argv[1])
    if not path.exists():
        path = Path(__file__).resolve().parent / sys.argv[1]
    batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 1
    size = None
    with gzip.open(path, "rt", encoding="utf-8") as f:
        log = json.load(f)
    for event in log:
        if event.get("ev") == "batch":
            size = event["size"]
        elif event.get("ev") is None and size == batch:
            print(event["n"], event["out"], event["chose"], "P" if event["probed"] else "-", event.get("a"),
                  event.get("model"), "loses" if event.get("loses") else "-", event.get("miss", "-"), event.get("unread"),
                  event.get("start"))


if __name__ == "__main__":
    main()
