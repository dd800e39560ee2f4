"""benchmarks/gpu.py's arithmetic (the GPU run itself is a manual step: see BENCHMARKS.md)."""

from __future__ import annotations

import json

import pytest
from model_helpers import load_script

from xtokspec.types import expected_tokens


@pytest.fixture(scope="module")
def gpu():
    return load_script("benchmarks/gpu.py")


def test_verify_cost_interpolates_and_extrapolates(gpu):
    costs = {1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}
    assert gpu.verify_cost(costs, 0) == 10.0  # m proposals + the bonus row
    assert gpu.verify_cost(costs, 2) == pytest.approx(12.0)  # 3 rows: between 2 and 4
    assert gpu.verify_cost(costs, 11) == pytest.approx(21.0)  # 12 rows: the line through 4 and 8, not 8's cost
    assert gpu.verify_cost({1: 10.0}, 5) == 10.0  # one point: no line to follow


def test_prediction_is_eq1_over_the_cycles(gpu, tmp_path):
    """One run, alpha 0.5, two cycles of 2 proposals, 4 draft steps: tokens per cycle 1.75."""
    stats = {"target_forwards": 2, "draft_forwards": 4, "token_acceptance": 0.5, "proposal_lengths": [2, 2]}
    (tmp_path / "results.json").write_text(json.dumps({"runs": [{"system": "x", "mode": "greedy", "stats": stats}]}))
    pair = {"target_compiled": {1: 10.0, 2: 10.0, 4: 10.0}, "draft_compiled": {1: 1.0}}
    (row,) = gpu.predict(pair, tmp_path / "results.json", overhead_s=0.0)
    cost = (4 / 2) * 1.0 + 10.0  # draft steps per cycle * step + verify(3 rows)
    assert row["predicted_speedup"] == pytest.approx(expected_tokens(0.5, 2) / (cost / 10.0))
    assert gpu.predict(pair, tmp_path / "missing.json", 0.0) == []
    # the eager (static-cache) prediction uses the eager costs, over the eager target step
    pair |= {"target_static": {1: 20.0, 2: 20.0, 4: 24.0}, "draft_static": {1: 6.0}}
    (eager,) = gpu.predict(pair, tmp_path / "results.json", 0.0, costs="static")
    assert eager["predicted_speedup"] == pytest.approx(expected_tokens(0.5, 2) / (((4 / 2) * 6.0 + 22.0) / 20.0))


def test_shapes_are_the_published_ones(gpu):
    target, draft = gpu.shapes(tiny=False)["13b"]
    assert (target.n_layer, target.n_embd, target.n_head, target.vocab_size) == (40, 5120, 40, 50570)
    assert (draft.num_hidden_layers, draft.hidden_size, draft.vocab_size) == (12, 768, 52096)


def test_loop_timer_brackets_every_model_call_and_restores(bridged_spec):
    """gpu_loop.py's overhead is wall time minus the bracketed calls: on a CPU they are timed on the host, so the
    bracketed time must be positive, below the wall time, and ModelState must be untouched afterwards."""
    import time

    from xtokspec.runtime.cache import ModelState

    loop = load_script("benchmarks/gpu_loop.py")
    before = {name: getattr(ModelState, name) for name in loop.CallTimer.METHODS}
    with loop.CallTimer("cpu", bridged_spec.target_model) as timer:
        start = time.perf_counter()
        result = bridged_spec.generate("使用する C コンパイラが", max_new_tokens=8)
        wall = time.perf_counter() - start
    assert result.stats.target_forwards >= 1
    calls = timer.seconds()  # per role and method
    assert 0 < sum(calls.values()) < wall
    assert {"target forward", "draft forward"} <= set(calls), calls
    assert {name: getattr(ModelState, name) for name in loop.CallTimer.METHODS} == before


def test_tree_prediction_costs_levels_and_verification_at_their_compiled_buckets(gpu, tmp_path):
    """A width-4 tree: each draft forward costs a 4-id draft call, each verification of m nodes the compiled
    target at the bucket of m + 1 ids (compiled), or eagerly at m + 1 ids (static); tokens per cycle as measured."""
    stats = {"target_forwards": 2, "draft_forwards": 4, "token_acceptance": 0.5, "proposal_lengths": [4, 6],
             "new_tokens": 6, "proposal": "onehot tree"}
    (tmp_path / "results.json").write_text(json.dumps({"runs": [{"system": "x-tree4", "mode": "T=0.7", "stats": stats}]}))
    pair = {"target_compiled": {1: 10.0, 2: 10.0, 4: 12.0, 8: 14.0}, "draft_compiled": {1: 1.0, 4: 1.5},
            "target_static": {1: 20.0, 2: 20.0, 4: 24.0, 8: 28.0}, "draft_static": {1: 5.0, 2: 5.0, 4: 6.0}}
    (row,) = gpu.predict(pair, tmp_path / "results.json", overhead_s=0.0)
    assert row["predicted_speedup"] == pytest.approx(3 / ((2 * 1.5 + (14.0 + 14.0) / 2) / 10.0))  # 5 and 7 ids -> 8
    (eager,) = gpu.predict(pair, tmp_path / "results.json", 0.0, costs="static")
    assert eager["predicted_speedup"] == pytest.approx(3 / ((2 * 6.0 + (25.0 + 27.0) / 2) / 20.0))
    pair["target_tree_compiled"] = {8: 16.0, 16: 18.0, 32: 22.0}  # measured tree-masked costs
    (masked,) = gpu.predict(pair, tmp_path / "results.json", overhead_s=0.0)
    assert masked["predicted_speedup"] == pytest.approx(3 / ((2 * 1.5 + (16.0 + 16.0) / 2) / 10.0))
    (eager_again,) = gpu.predict(pair, tmp_path / "results.json", 0.0, costs="static")  # compiled costs only
    assert eager_again["predicted_speedup"] == pytest.approx(eager["predicted_speedup"])
    (dearer,) = gpu.predict(pair, tmp_path / "results.json", overhead_s=1.0, tree_overhead_s=3.0)  # a tree's own
    assert dearer["predicted_speedup"] == pytest.approx(3 / ((2 * 1.5 + 16.0 + 3.0) / 10.0))
    del pair["target_tree_compiled"]
    del pair["draft_compiled"][4]  # not measured (older stored costs): the 1-id call's
    (older,) = gpu.predict(pair, tmp_path / "results.json", overhead_s=0.0)
    assert older["predicted_speedup"] == pytest.approx(3 / ((2 * 1.0 + 14.0) / 10.0))
