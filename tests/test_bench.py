"""`xtokspec bench`: the figures it derives from timed runs, and one small end-to-end run on the fixtures."""

from __future__ import annotations

import json

import pytest

from xtokspec.cli.main import main
from xtokspec.cli.report import (
    Run,
    comparisons,
    eos_check,
    markdown_table,
    paired,
    summarize,
    theoretical_speedup,
)
from xtokspec.runtime.models import fixtures_dir
from xtokspec.types import GenerationStats


def _runs(system: str, seconds_per_token: list[float], mode: str = "greedy", eos: list[bool] | None = None,
          stats: dict | None = None) -> list[Run]:
    eos = eos or [False] * len(seconds_per_token)
    return [Run(system, mode, i, 10 * s, 10, 10, 0, stats or {}, e)
            for i, (s, e) in enumerate(zip(seconds_per_token, eos, strict=True))]


def test_speedup_is_per_prompt_target_time_over_system_time():
    runs = _runs("target", [1.0, 2.0, 4.0]) + _runs("fast", [0.5, 1.0, 1.0])
    row = next(r for r in summarize(runs) if r["system"] == "fast")
    assert row["speedups"] == [2.0, 2.0, 4.0]
    assert row["speedup"] == 2.0 and row["speedup_q1"] == 2.0 and row["speedup_q3"] == 3.0


def test_paired_ratio_and_bootstrap_interval():
    runs = _runs("a", [1.0, 1.0, 1.0, 1.0]) + _runs("b", [2.0, 2.2, 1.8, 2.0])
    result = paired(runs, "greedy", "a", "b")
    assert result["median_ratio"] == pytest.approx(2.0) and result["wins"] == 4 and result["prompts"] == 4
    assert result["ci_low"] <= result["mean_ratio"] <= result["ci_high"]
    assert 1.8 <= result["ci_low"] and result["ci_high"] <= 2.2
    assert paired(runs, "greedy", "a", "missing") is None
    swapped = paired(runs, "greedy", "b", "a")
    assert swapped["wins"] == 0 and swapped["median_ratio"] == pytest.approx(0.5)


def test_comparisons_only_lists_pairs_that_ran():
    runs = _runs("xtokspec-same", [1.0, 1.0]) + _runs("hf-assisted", [1.1, 0.9]) + _runs("target", [2.0, 2.0])
    pairs = comparisons(runs)
    assert [(p["a"], p["b"]) for p in pairs] == [("xtokspec-same", "hf-assisted")]


def test_tree_systems_are_compared_with_the_chains_and_an_unpruned_tree_with_its_pruned_twin():
    from xtokspec.cli.report import tree_pairs

    pairs = tree_pairs(["xtokspec-bridged", "xtokspec-bridged-tree4", "xtokspec-bridged-tree4-all",
                        "xtokspec-bridged-tree4-top"])
    assert ("xtokspec-bridged-tree4", "xtokspec-bridged") in pairs
    assert ("xtokspec-bridged-tree4", "xtokspec-bridged-intersection") in pairs
    assert ("xtokspec-bridged-tree4", "xtokspec-bridged-tree4-all") in pairs
    assert ("xtokspec-bridged-tree4", "xtokspec-bridged-tree4-top") in pairs  # sampled root vs top candidates
    assert not any(a.endswith(("-all", "-top")) for a, _ in pairs)  # only as the baseline of its twin


def test_trimmed_head_systems_are_compared_with_their_full_head_twins():
    from xtokspec.cli.report import tree_pairs, trim_pairs

    names = ["xtokspec-bridged", "xtokspec-bridged-trim", "xtokspec-bridged-auto", "xtokspec-bridged-auto-trim",
             "xtokspec-bridged-tree4", "xtokspec-bridged-tree4-trim"]
    assert trim_pairs(names) == [("xtokspec-bridged-trim", "xtokspec-bridged"),
                                 ("xtokspec-bridged-auto-trim", "xtokspec-bridged-auto")]
    assert set(tree_pairs(["xtokspec-bridged-tree4-trim"])) == {
        ("xtokspec-bridged-tree4-trim", "xtokspec-bridged-tree4"),
        ("xtokspec-bridged-tree4-trim", "xtokspec-bridged-auto-trim")}


def test_eos_check_flags_a_sampler_that_never_stops_and_passes_an_equal_one():
    target = _runs("target", [1.0] * 12, "T=0.7", [True] * 10 + [False] * 2)
    never = _runs("never-stops", [1.0] * 12, "T=0.7", [False] * 12)
    same = _runs("lossless", [1.0] * 12, "T=0.7", [True] * 9 + [False] * 3)
    assert eos_check(never, target)["eos_p"] < 1e-3  # the negative control: this check can fail
    check = eos_check(same, target)
    assert check["eos_share"] == 0.75 and check["eos_p"] > 0.5


def test_theoretical_speedup_matches_the_closed_form():
    # alpha = 0.5, K = 2 every cycle: (1 - 0.5^3) / 0.5 = 1.75 tokens per cycle; a cycle costs 0.5 target steps
    stats = {"target_forwards": 4, "drafted": 8, "accepted": 4, "token_acceptance": 0.5,
             "proposal_lengths": [2, 2, 2, 2], "draft_seconds": 1.0, "verify_seconds": 1.0}
    assert theoretical_speedup(stats, target_step=1.0) == pytest.approx(1.75 / 0.5)
    # K = 1 and K = 3: the expected tokens are averaged over the cycles' own K, (1.5 + 1.875) / 2
    stats["proposal_lengths"] = [1, 3, 1, 3]
    assert theoretical_speedup(stats, target_step=1.0) == pytest.approx(1.6875 / 0.5)
    assert theoretical_speedup({}, 1.0) is None
    # half the cycles run the target alone: the bound stands; three in four: no bound from the one that drafted
    stats["alone_cycles"] = 2
    assert theoretical_speedup(stats, target_step=1.0) == pytest.approx(1.6875 / 0.5)
    stats["alone_cycles"] = 3
    assert theoretical_speedup(stats, target_step=1.0) is None


def test_token_acceptance_is_the_per_token_alpha_not_the_accepted_share():
    # cycle 1: 4 proposals, 3 accepted, then a rejection; cycle 2: 2 proposals, both accepted
    stats = GenerationStats(target_forwards=2, drafted=6, accepted=5, rejections=1)
    assert stats.acceptance_rate == pytest.approx(5 / 6)
    assert stats.token_acceptance == pytest.approx(5 / 6)
    # cycle 1: 4 proposals, the first rejected (the other 3 are never judged): alpha 0, share 0
    # cycle 2: 2 proposals, both accepted. Share 2/6, but alpha = 2 accepted / (2 + 1 rejection)
    stats = GenerationStats(target_forwards=2, drafted=6, accepted=2, rejections=1)
    assert stats.acceptance_rate == pytest.approx(2 / 6) and stats.token_acceptance == pytest.approx(2 / 3)


def test_markdown_table_has_one_line_per_row_and_the_eos_column():
    runs = _runs("target", [1.0, 1.0], "T=0.7", [True, False]) + _runs("x", [0.5, 0.5], "T=0.7", [True, True])
    table = markdown_table(summarize(runs))
    assert len(table.splitlines()) == 2 + 2 and "EOS stops" in table and "100% (p=" in table


def test_bench_calibration_refusals_come_before_any_model_loads(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    for argv, message in ((["--calibration", str(empty)], "give --draft-vocab too"),
                          (["--draft-vocab", "64", "--calibration", str(empty)], "has no text"),
                          (["--draft-vocab", "64", "--calibration", str(tmp_path / "missing.txt")], "cannot read --calibration")):
        # the real preset's models are never loaded (they need not even be on this machine)
        assert main(["bench", "--preset", "real", "--out", str(tmp_path), *argv]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_end_to_end_on_the_fixtures(tmp_path, capsys, ja_target):
    calibration = tmp_path / "calibration.txt"  # the draft's head is trimmed to ids frequent in these lines
    heldout = (fixtures_dir() / "data" / "heldout.txt").read_text(encoding="utf-8").splitlines()
    calibration.write_text("\n".join(heldout[:200]), encoding="utf-8")
    assert main(["bench", "--prompts", "1", "--max-new-tokens", "8", "--modes", "greedy", "T=0.7",
                 "--threads", "1", "--out", str(tmp_path), "--no-progress", "--draft-vocab", "2048",
                 "--calibration", str(calibration)]) == 0
    results = json.loads((tmp_path / "fixtures" / "results.json").read_text())
    systems = {(r["mode"], r["system"]) for r in results["summary"]}
    for mode in ("greedy", "T=0.7"):
        assert {(mode, s) for s in ("target", "hf-assisted", "xtokspec-same", "hf-universal")} <= systems
    assert ("greedy", "xtokspec-bridged") in systems and ("T=0.7", "xtokspec-bridged-intersection") in systems
    assert all(r["new_tokens"] > 0 and r["seconds"] > 0 for r in results["runs"])
    for stats in (r["stats"] for r in results["runs"] if r["stats"]):
        assert stats["rejections"] <= stats["target_forwards"] == len(stats["proposal_lengths"])
        assert stats["token_acceptance"] >= stats["acceptance_rate"]
    assert any(c["a"] == "xtokspec-same" and c["b"] == "hf-assisted" for c in results["comparisons"])
    assert {("greedy", "xtokspec-bridged-trim"), ("T=0.7", "xtokspec-bridged-auto-trim"),
            ("T=0.7", "xtokspec-bridged-tree4-trim")} <= systems  # --draft-vocab: the trimmed head's twins
    assert any(c["a"] == "xtokspec-bridged-trim" and c["b"] == "xtokspec-bridged" for c in results["comparisons"])
    assert (tmp_path / "fixtures" / "speedup.png").stat().st_size > 0
    assert (tmp_path / "fixtures" / "speedup_vs_temperature.png").stat().st_size > 0
    assert "xtokspec-bridged" in capsys.readouterr().out
    table = (tmp_path / "fixtures" / "table.md").read_text()
    assert main(["bench", "--report-only", "--out", str(tmp_path)]) == 0  # figures re-derived from the runs
    assert (tmp_path / "fixtures" / "table.md").read_text() == table


def test_bench_compile_runs_every_xtokspec_system_compiled_and_warmed_up(monkeypatch):
    """`xtokspec bench --compile`: the xtokspec systems run with compile=True (torch.compile as the identity
    here: the padded buckets run eagerly through the same code), each warmed up, for its chain and its trees,
    before any is timed."""
    import torch

    from xtokspec.cli.bench import run_benchmark
    from xtokspec.cli.presets import load_preset
    from xtokspec.spec import XTokSpec

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    warmed = []
    real_warmup = XTokSpec.warmup
    monkeypatch.setattr(XTokSpec, "warmup", lambda self, *a, **k: warmed.append(k.get("tree_width")) or real_warmup(self, *a, **k))
    models = load_preset("fixtures", torch.float32)
    prompt = (fixtures_dir() / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()[0]
    runs = run_benchmark(models, ["greedy"], [prompt], 8, progress=False, tree_widths=(2,), compile=True,
                         only=("xtokspec-same", "xtokspec-bridged", "xtokspec-bridged-tree2"))
    ours = [r for r in runs if not r.system.startswith("target")]
    assert {r.system for r in ours} == {"xtokspec-same", "xtokspec-bridged", "xtokspec-bridged-tree2"}
    assert all(r.stats["cache"] == "static/static+compile" for r in ours)
    assert all(r.new_tokens == 8 for r in ours)
    assert sorted(warmed) == [1, 1, 2]  # the chosen systems only: two chains and the bridged draft's width-2 tree


def test_bench_default_is_the_default_configuration_eager_on_a_cpu(monkeypatch):
    """`xtokspec bench` without --compile runs the xtokspec systems with SpecConfig's default ("auto"): on a CPU
    eagerly on the dynamic cache, nothing warmed up, and the eager static-cache twins present; --compile's words
    reach the systems' config."""
    import torch

    from xtokspec.cli.bench import run_benchmark
    from xtokspec.cli.main import build_parser
    from xtokspec.cli.presets import load_preset
    from xtokspec.spec import XTokSpec

    warmed = []
    monkeypatch.setattr(XTokSpec, "warmup", lambda self, *a, **k: warmed.append(k) or 0)
    models = load_preset("fixtures", torch.float32)
    prompt = (fixtures_dir() / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()[0]
    runs = run_benchmark(models, ["greedy"], [prompt], 8, progress=False,
                         only=("xtokspec-same", "xtokspec-bridged", "xtokspec-bridged-static"))
    caches = {r.system: r.stats["cache"] for r in runs if r.system != "target"}
    assert caches == {"xtokspec-same": "dynamic/dynamic", "xtokspec-bridged": "dynamic/dynamic",
                      "xtokspec-bridged-static": "static/static"}
    assert warmed == []
    parser = build_parser()
    for argv, value in (([], "auto"), (["--compile"], True), (["--compile", "off"], False),
                        (["--compile", "graphs"], "graphs")):
        got = parser.parse_args(["bench", *argv]).compile
        assert got == value and type(got) is type(value), (argv, got)


def test_captured_systems_run_beside_transformers_static_cache_target(monkeypatch):
    """Where xtokspec captures its steps, `target-static` (the target alone through transformers' generate on one
    static cache size for every prompt, which transformers compiles on a GPU) runs beside them, its greedy text
    the eager target's; each xtokspec run's target calls are its own count (CUDA graph replays bypass forward
    hooks). On a CPU without --compile there is no target-static."""
    import torch

    from xtokspec.cli.bench import run_benchmark
    from xtokspec.cli.presets import load_preset
    from xtokspec.cli.report import comparisons

    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    models = load_preset("fixtures", torch.float32)
    prompts = (fixtures_dir() / "data" / "prompts.txt").read_text(encoding="utf-8").splitlines()[:2]
    texts = {}
    real_generate = type(models.target[0]).generate

    def generate(self, *args, **kwargs):  # the token ids each transformers run returns, per cache kind
        out = real_generate(self, *args, **kwargs)
        texts.setdefault(kwargs.get("cache_implementation", "dynamic"), []).append(out[0].tolist())
        return out

    monkeypatch.setattr(type(models.target[0]), "generate", generate)
    runs = run_benchmark(models, ["greedy"], prompts, 8, progress=False, compile=True, only=("xtokspec-bridged",))
    assert {r.system for r in runs} == {"target", "target-static", "xtokspec-bridged"}
    assert texts["static"] == texts["dynamic"] and len(texts["static"]) == 3  # the warm-up call, then two prompts
    assert all(r.target_calls == r.stats["target_forwards"] for r in runs if r.stats)
    assert {(c["a"], c["b"]) for c in comparisons(runs)} == {("xtokspec-bridged", "target-static"),
                                                            ("target-static", "target")}
    eager = run_benchmark(models, ["greedy"], prompts[:1], 4, progress=False, only=("xtokspec-bridged",))
    assert {r.system for r in eager} == {"target", "xtokspec-bridged"}


def test_systems_that_do_not_run_are_refused_before_anything_is_timed(tmp_path, capsys):
    """--systems names a system that no mode has, or only systems that a mode lacks (greedy's xtokspec-bridged at
    T=0.7, where the bridged chains are named by their proposal): refused with what exists, before any run."""
    for systems, message in ((["xtokspec-brigded"], "no system named ['xtokspec-brigded']"),
                             (["xtokspec-bridged"], "none of ['xtokspec-bridged'] runs in mode T=0.7")):
        assert main(["bench", "--modes", "greedy", "T=0.7", "--prompts", "1", "--no-progress", "--out",
                     str(tmp_path), "--systems", *systems]) == 2
        err = capsys.readouterr().err
        assert message in err and "xtokspec-bridged-intersection" in err, err
    assert not (tmp_path / "fixtures" / "results.json").exists()


def test_report_only_without_an_earlier_run_names_the_missing_file(tmp_path, capsys):
    assert main(["bench", "--report-only", "--out", str(tmp_path)]) == 2
    assert "results.json" in capsys.readouterr().err


def test_tree_bound_from_per_call_totals(tmp_path):
    """benchmarks/tree_bound.py on made-up totals whose answer is worked by hand. Tree: 20 tokens in 10 calls of
    0.2 s, 0.15 s of each verifying; chain: 15 tokens in 10 calls of 0.1 s, 0.08 s verifying. Measured speed ratio
    (2 / 0.2) / (1.5 / 0.1) = 2/3; with the tree verified at the chain's 0.08 s a call costs 0.13 s, so the bound is
    (2 / 0.13) / 15 = 1.0256. A fallback run (target-alone cycles) and the other mode are left out."""
    from model_helpers import load_script

    def run(system, mode, calls, tokens, wall, verify, alone=0):
        stats = {"target_forwards": calls, "new_tokens": tokens, "wall_seconds": wall, "verify_seconds": verify,
                 "alone_cycles": alone}
        return {"system": system, "mode": mode, "stats": stats}

    runs = [run("x-bridged-tree4", "T=0.7", 6, 12, 1.2, 0.9), run("x-bridged-tree4", "T=0.7", 4, 8, 0.8, 0.6),
            run("x-bridged-onehot", "T=0.7", 10, 15, 1.0, 0.8), run("x-bridged-intersection", "T=0.7", 9, 9, 1.0, 0.9, alone=3),
            run("x-bridged-onehot", "greedy", 10, 30, 1.0, 0.8), {"system": "target", "mode": "T=0.7"}]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": runs}))
    rows = load_script("benchmarks/tree_bound.py").rows(str(path), "T=0.7")
    assert [row[:2] for row in rows] == [("x-bridged-tree4", "x-bridged-onehot")]
    _, _, tree_tokens, chain_tokens, measured, bound = rows[0]
    assert (tree_tokens, chain_tokens) == pytest.approx((2.0, 1.5))
    assert measured == pytest.approx(2 / 3)
    assert bound == pytest.approx(2 / 0.13 / 15)
