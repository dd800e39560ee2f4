"""Policies and cycle records for tests: a scripted fallback passed in through `XTokSpec.fallback_policy`,
made-up `CycleRecord`s for the policies' unit tests, and a simulated clock for the loop's timings."""

from __future__ import annotations

from xtokspec.types import CycleRecord


class Scripted:
    """A fallback policy whose choice is `pattern(self)`, from the drafted cycles so far (`cycles`) and the
    target-alone cycles since the last drafted one (`since_draft`)."""

    def __init__(self, pattern):
        self.pattern = pattern
        self.cycles = 0
        self.since_draft = 0

    def observe(self, cycle: CycleRecord) -> None:
        if cycle.alone:
            self.since_draft += 1
        else:
            self.cycles += 1
            self.since_draft = 0

    def run_alone(self) -> bool:
        return self.pattern(self)


def always_draft(config) -> Scripted:
    """`XTokSpec.fallback_policy` for runs that draft every cycle (as SpecConfig(fallback=False))."""
    return Scripted(lambda policy: False)


def scripted(pattern):
    """`XTokSpec.fallback_policy` that runs `pattern` (see Scripted)."""
    return lambda config: Scripted(pattern)


def drafted(draft_steps: int, depth: int, accepted: int, draft_s: float, verify_s: float | None, *,
            nodes: int | None = None, rejected: bool | None = None, size: int | None = None,
            predicted: float | None = None, committed: int | None = None, bridge_s: float = 0.0) -> CycleRecord:
    """A drafted cycle's record; verify_s None: a prefilling cycle (its verification also fed the prompt)."""
    nodes = depth if nodes is None else nodes
    return CycleRecord.drafted(
        kind="onehot", draft_steps=draft_steps, depth=depth, nodes=nodes, accepted=accepted,
        rejected=accepted < depth if rejected is None else rejected,
        committed=accepted + 1 if committed is None else committed, draft_s=draft_s, bridge_s=bridge_s,
        verify_s=0.0 if verify_s is None else verify_s, prefill=verify_s is None, size=size, predicted=predicted,
    )


def alone(seconds: float) -> CycleRecord:
    """A target-alone cycle's record."""
    return CycleRecord.target_alone(committed=1, seconds=seconds, prefill=False)


class SimulatedClock:
    """The loop's clock (`XTokSpec.clock`, which every second the loop and its policies see is read from),
    advanced only where a test says: by a model's forwards, the seconds each is given (`costs`), or by hand
    (`now`). The policies see the same timings on any machine, under any load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def costs(self, monkeypatch, model, seconds: float) -> None:
        forward = model.forward

        def timed(*args, **kwargs):
            self.now += seconds
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", timed)


def simulated_clock(monkeypatch) -> SimulatedClock:
    """A SimulatedClock handed to every XTokSpec as its clock (the test's monkeypatch puts the real one back)."""
    from xtokspec import XTokSpec

    clock = SimulatedClock()
    monkeypatch.setattr(XTokSpec, "clock", staticmethod(clock.perf_counter))
    return clock
