"""benchmarks/gpu.py's arithmetic (the GPU run itself is a manual step: see BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest
from model_helpers import load_script

from xtokspec.types import expected_tokens


@pytest.fixture(scope="module")
def gpu():
    return load_script("benchmarks/gpu.py")


def test_verify_cost_interpolates_and_clamps(gpu):
    costs = {1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}
    assert gpu.verify_cost(costs, 0) == 10.0  # m proposals + the bonus row
    assert gpu.verify_cost(costs, 2) == pytest.approx(12.0)  # 3 rows: between 2 and 4
    assert gpu.verify_cost(costs, 20) == 17.0  # beyond the measured range: the largest


def test_prediction_is_eq1_over_the_cycles(gpu, tmp_path):
    """One run, alpha 0.5, two cycles of 2 proposals, 4 draft steps: tokens per cycle 1.75."""
    stats = {"target_forwards": 2, "draft_forwards": 4, "token_acceptance": 0.5, "proposal_lengths": [2, 2]}
    (tmp_path / "results.json").write_text(json.dumps({"runs": [{"system": "x", "mode": "greedy", "stats": stats}]}))
    pair = {"target_compiled": {1: 10.0, 2: 10.0, 4: 10.0}, "draft_compiled": {1: 1.0}}
    (row,) = gpu.predict(pair, tmp_path / "results.json", overhead_s=0.0)
    cost = (4 / 2) * 1.0 + 10.0  # draft steps per cycle * step + verify(3 rows)
    assert row["predicted_speedup"] == pytest.approx(expected_tokens(0.5, 2) / (cost / 10.0))
    assert gpu.predict(pair, tmp_path / "missing.json", 0.0) == []


def test_shapes_are_the_published_ones(gpu):
    target, draft = gpu.shapes(tiny=False)["13b"]
    assert (target.n_layer, target.n_embd, target.n_head, target.vocab_size) == (40, 5120, 40, 50570)
    assert (draft.num_hidden_layers, draft.hidden_size, draft.vocab_size) == (12, 768, 52096)
