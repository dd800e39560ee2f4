"""Sampled requests end where their text draws EOS, and the proposer's drafts change which uniforms a seeded request
draws (vLLM's generators draw one per drafted token), so at T=0.7 a prompt's output with the proposer is another
draw of the target's law than the target alone's, of another length. Its tokens/s then carries the prompt's prefill
over another number of tokens. Per system and prompt (batch 1, each prompt its own batch): the table's ratio (tokens/s
against the target alone's), and the ratio at equal length: the target alone's seconds for as many tokens as the
system gave (its first steps, one token each: the prefill's, then one per decode step; past its own end, its median
decode step a token) over the system's seconds.

    python benchmarks/results/epyc-avx2/vllm-adaptive/fixtures-t07-steps/lengths.py > output-lengths.txt
"""

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))
from common import lower_bound  # noqa: E402

data = json.loads((HERE / "results.json").read_text(encoding="utf-8"))
alone = data["runs"]["alone"]


def alone_seconds(steps: list[list[float]], n: int) -> float:
    """The target alone's seconds for its first n tokens of one prompt (a step a token)."""
    if n <= len(steps):
        return sum(s[0] for s in steps[:n])
    step = statistics.median(s[0] for s in steps[1:]) if len(steps) > 1 else steps[0][0]
    return sum(s[0] for s in steps) + (n - len(steps)) * step


for name, rounds in data["runs"].items():
    if name == "alone":
        continue
    table, equal, tokens, alone_tokens = [], [], 0, 0
    for run, base in zip(rounds, alone, strict=True):
        mine, theirs = run["batch1"], base["batch1"]
        for t, n, ta, na, steps in zip(mine["times"], mine["tokens"], theirs["times"], theirs["tokens"],
                                       theirs["steps"], strict=True):
            table.append((n / t) / (na / ta))
            equal.append(alone_seconds(steps, n) / t)
            tokens += n
            alone_tokens += na
    print(f"{name}: tokens/s against the target alone, per prompt {statistics.median(table):.3f} "
          f"[{lower_bound(table):.3f}]; at equal length {statistics.median(equal):.3f} [{lower_bound(equal):.3f}]; "
          f"tokens {tokens} against the target alone's {alone_tokens} over {len(table)} prompt runs")
