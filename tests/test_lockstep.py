"""`benchmarks/vllm_bench.py`'s lockstep loop (`run_lockstep`) on stand-in engines, without vLLM: every engine
serves every prompt, its steps timed in turn, and `running` (`--queued`) holds each engine to that many requests
at once, the next prompt started as one ends."""

from __future__ import annotations

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

    def add_request(self, request_id, prompt, params):
        self.running[request_id] = [prompt, []]
        self.order.append(prompt)
        self.most = max(self.most, len(self.running))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
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
    return {name: (types.SimpleNamespace(llm_engine=Engine()), []) for name in ("a", "b")}


@pytest.mark.parametrize("running", [None, 1, 3])
def test_lockstep_serves_every_prompt_on_every_engine_at_most_running_at_once(engines, running):
    prompts = ["x" * n for n in (5, 1, 3, 7, 2, 4, 6)]
    done = vllm_bench.run_lockstep(engines, prompts, 64, running=running)
    for name, (seconds, outputs) in done.items():
        engine = engines[name][0].llm_engine
        assert seconds > 0
        assert [len(o) for o in outputs] == [len(p) for p in prompts]  # each request's ids, in the prompts' order
        assert engine.order == prompts  # admitted in order
        assert engine.most == (running or len(prompts))
