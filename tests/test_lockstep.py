"""`benchmarks/vllm_bench.py`'s lockstep loop (`run_lockstep`) on stand-in engines, without vLLM: every engine
serves every prompt, its steps timed in turn, and `running` (`--queued`) holds each engine to that many requests
at once, the next prompt started as one ends."""

from __future__ import annotations

import gc
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vllm_bench  # noqa: E402


class Engine:
    """A stand-in for vLLM's engine: a request runs len(prompt) steps, one token a step."""

    def __init__(self):
        self.running: dict[str, list] = {}
        self.order: list[str] = []  # prompts in the order they were admitted
        self.most = 0  # requests running at once, at most
        self.steps = 0
        self.proposers: list = []  # stand-ins for the xtokspec proposers built with it

    def add_request(self, request_id, prompt, params):
        self.running[request_id] = [prompt, []]
        self.order.append(prompt)
        self.most = max(self.most, len(self.running))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self.steps += 1
        if self.steps % 3 == 0:
            gc.collect()  # a collection inside the step: counted in it
        for proposer in self.proposers:  # a proposer's call after the step: 2 ids proposed
            proposer.stats.proposed += 2
        outputs = []
        for request_id, (prompt, tokens) in list(self.running.items()):
            tokens.append(len(tokens))
            finished = len(tokens) == len(prompt)
            outputs.append(types.SimpleNamespace(request_id=request_id, finished=finished,
                                                 outputs=[types.SimpleNamespace(token_ids=list(tokens))]))
            if finished:
                del self.running[request_id]
        return outputs


@pytest.fixture
def engines(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(SamplingParams=lambda **kw: kw))
    engines = {name: (types.SimpleNamespace(llm_engine=Engine()), []) for name in ("a", "b")}
    proposer = types.SimpleNamespace(_last_end=None, stats=types.SimpleNamespace(proposed=0))
    engines["b"][0].llm_engine.proposers.append(proposer)
    engines["b"][1].append(proposer)
    return engines


@pytest.mark.parametrize("running", [None, 1, 3])
def test_lockstep_serves_every_prompt_on_every_engine_at_most_running_at_once(engines, running):
    prompts = ["x" * n for n in (5, 1, 3, 7, 2, 4, 6)]
    done = vllm_bench.run_lockstep(engines, prompts, 64, running=running)
    for name, (seconds, outputs, steps) in done.items():
        engine = engines[name][0].llm_engine
        assert seconds > 0
        # every step recorded, its seconds summing to the engine's (rounded to 10 us a step), the ids engine b's
        # proposer proposed in it, and the collections run inside it
        assert len(steps) == engine.steps
        assert sum(s for s, _, _ in steps) == pytest.approx(seconds, abs=1e-5 * len(steps))
        assert all(proposed == (2 if name == "b" else 0) for _, proposed, _ in steps)
        assert all(0 <= collected <= spent + 1e-5 for spent, _, collected in steps)
        assert sum(collected > 0 for _, _, collected in steps) >= engine.steps // 3  # each step's own collections
        assert [len(o) for o in outputs] == [len(p) for p in prompts]  # each request's ids, in the prompts' order
        assert engine.order == prompts  # admitted in order
        assert engine.most == (running or len(prompts))


def test_pool_lays_rounds_of_separate_processes_side_by_side_and_refuses_other_prompts(tmp_path):
    """`--pool`: two one-round results.json become one of two rounds, whose table pairs each round with its own
    target alone; a file that served other prompts is refused by name."""

    def one(name, alone, other, prompts=("p", "q")):
        row = lambda seconds: {"times": [seconds, seconds], "tokens": [10, 10], "outputs": [[1], [2]],  # noqa: E731
                               "drafted": 0, "accepted": 0}
        data = {"header": "h", "command": f"run {name}", "target": "t", "dtype": "float32", "prompts": list(prompts),
                "warm": [], "batches": [1],
                "runs": {"alone": [{"cold": {"seconds": 1, "tokens": 1}, "batch1": row(alone)}],
                         "x": [{"cold": {"seconds": 1, "tokens": 1}, "batch1": row(other)}]}}
        path = tmp_path / name / "results.json"
        path.parent.mkdir()
        path.write_text(vllm_bench.json.dumps(data), encoding="utf-8")
        return path

    a, b = one("run-1", 1.0, 0.5), one("run-2", 2.0, 2.5)
    vllm_bench.pool([a, b], tmp_path / "pooled" / "results.json")
    pooled = vllm_bench.json.loads((tmp_path / "pooled" / "results.json").read_text(encoding="utf-8"))
    assert [r["batch1"]["times"][0] for r in pooled["runs"]["x"]] == [0.5, 2.5]
    assert "2 processes pooled (run-1, run-2)" in pooled["header"] and pooled["command"] == "run run-1 && run run-2"
    table = (tmp_path / "pooled" / "table.md").read_text(encoding="utf-8")
    assert "| x | 1 | 12.0 | 1.400 [0.800] | 1.400 (0.800-2.000) |" in table  # ratios 2, 2, 0.8, 0.8
    with pytest.raises(SystemExit, match="run-3.*another prompts"):
        vllm_bench.pool([a, one("run-3", 1.0, 1.0, prompts=("p", "r"))], tmp_path / "bad" / "results.json")


def test_processes_run_the_same_command_in_fresh_processes_in_abba_order(tmp_path):
    """`--processes N`: each process gets the run's own options, the systems in reverse order every other time, and
    a results.json of its own beside --out; `--processes`, `--out` and `--systems` are given anew in either
    spelling."""
    out = tmp_path / "study" / "results.json"
    argv = ["--preset", "real", "--systems=alone,x", "--processes", "3", "--rounds", "1", f"--out={out}", "--lockstep"]
    runs = vllm_bench.process_runs(argv, ["alone", "x"], out, 3)
    assert [words for words, _ in runs] == [
        ["--preset", "real", "--rounds", "1", "--lockstep", "--systems", order, "--out", str(path)]
        for order, path in (("alone,x", tmp_path / "study" / "process-1" / "results.json"),
                            ("x,alone", tmp_path / "study" / "process-2" / "results.json"),
                            ("alone,x", tmp_path / "study" / "process-3" / "results.json"))]
    assert [path for _, path in runs] == [tmp_path / "study" / f"process-{n}" / "results.json" for n in (1, 2, 3)]
    assert vllm_bench.build_parser().parse_args(runs[1][0]).systems == "x,alone"
    with pytest.raises(SystemExit):  # an abbreviation would slip past the options given anew
        vllm_bench.build_parser().parse_args(["--proc", "2", "--out", str(out)])
