"""Every script in benchmarks/ still imports what it uses from xtokspec and parses its options: `--help` exits 0.

Run in a subprocess each (a script may set torch's threads or environment at import), from the checkout, with
the installed xtokspec; `common.py` is their shared helpers, not a script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "common.py")


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 20 and "compare_commits.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_answers_help(script):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], cwd=BENCHMARKS, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script} --help: exit {done.returncode}\n{done.stderr[-3000:]}"
    assert "usage" in done.stdout.lower(), done.stdout[-2000:]
