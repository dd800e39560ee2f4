"""`xtokspec generate --compare`'s timing and report, on a clock the test controls: which runs are timed, in
which order, and what the printed lines say about the ratio, its spread and a busy machine."""

from __future__ import annotations

import pytest

from xtokspec.cli.main import compare_report, time_sides


class Clock:
    """A clock that moves only when a fake generation says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sides(clock: Clock, ours_seconds: list[float], alone_seconds: list[float], tokens: int = 10):
    """Two fake generations of `tokens` tokens each, taking the given seconds in turn; the order they ran in."""
    order: list[str] = []
    ours_left, alone_left = list(ours_seconds), list(alone_seconds)

    def ours() -> int:
        order.append("ours")
        clock.now += ours_left.pop(0)
        return tokens

    def alone() -> int:
        order.append("alone")
        clock.now += alone_left.pop(0)
        return tokens

    return ours, alone, order


def test_the_first_run_of_the_target_alone_is_not_timed_and_pairs_alternate():
    clock = Clock()
    ours, alone, order = sides(clock, [1.0, 1.0, 1.0], [100.0, 2.0, 2.0, 2.0])  # a cold first run: 100 s
    ours_tps, alone_tps = time_sides(ours, alone, runs=3, clock=clock)
    assert order == ["alone", "ours", "alone", "alone", "ours", "ours", "alone"]
    assert ours_tps == [10.0, 10.0, 10.0] and alone_tps == [5.0, 5.0, 5.0]  # the 100-s run is in neither


def test_the_report_gives_the_median_ratio_and_its_spread_and_says_who_pays_the_first_forwards():
    lines = compare_report([10.0, 12.0, 11.0], [5.0, 6.0, 5.5], threads=1, load=0.0, cpus=2)
    assert len(lines) == 2, lines  # quiet machine, ratios all 2.0: the verdict, no notes
    assert "2.00x, the median of 3 pairs" in lines[0] and "IQR 2.00-2.00x" in lines[0]
    assert "the middle pair 12.0 against 6.0 tokens/s" in lines[0]  # every pair at 2.0x: sorted stably
    assert "1 torch thread both sides" in lines[0]
    assert "neither side pays the process's first forwards" in lines[0]
    assert "ran faster than the target alone" in lines[1]


def test_the_tokens_per_second_shown_are_the_median_pairs_not_each_sides_median():
    # each side's own median (48.0 against 48.8 tokens/s) points the other way from the median ratio (1.15x)
    ours, alone = [60.0, 55.0, 40.0, 48.0, 30.0], [50.0, 48.0, 48.8, 60.0, 20.0]
    lines = compare_report(ours, alone, threads=1, load=0.0, cpus=2)
    assert "1.15x" in lines[0] and "the middle pair 55.0 against 48.0 tokens/s" in lines[0], lines
    assert lines[1].startswith("not resolved"), lines  # ratios 0.80-1.50: on both sides of 1x


def test_a_ratio_resolved_below_one_is_called_slower():
    lines = compare_report([9.0, 9.5, 8.0, 9.2], [10.0, 10.0, 10.0, 10.0], threads=1, load=0.0, cpus=2)
    assert "ran slower than the target alone" in lines[1], lines


def test_a_wide_spread_is_noted_and_a_narrow_one_is_not():
    wide = compare_report([10.0, 20.0, 10.0, 20.0], [10.0, 10.0, 10.0, 10.0], threads=1, load=0.0, cpus=4)
    assert any("spread widely" in line for line in wide), wide
    narrow = compare_report([10.0, 10.4, 10.2, 10.3], [10.0, 10.0, 10.0, 10.0], threads=1, load=0.0, cpus=4)
    assert not any("spread" in line for line in narrow[1:]), narrow  # IQR under 10% of the median


@pytest.mark.parametrize(("load", "threads", "cpus", "busy"), [
    (0.1, 2, 2, False),  # alone on the machine
    (1.0, 1, 2, False),  # another job on the other CPU: no CPU is shared
    (1.0, 2, 2, True),   # another job and two threads here: three want two CPUs
    (4.0, 1, 4, True),   # every CPU taken by other work
])
def test_a_busy_machine_is_noted(load, threads, cpus, busy):
    lines = compare_report([10.0, 10.0], [10.0, 10.0], threads=threads, load=load, cpus=cpus)
    assert any("machine is busy" in line for line in lines) == busy, lines


def test_without_a_load_average_nothing_is_said_about_it():
    assert not any("busy" in line for line in compare_report([1.0], [1.0], threads=8, load=None, cpus=1))
