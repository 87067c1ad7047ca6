from __future__ import annotations

import pytest

from trainer_runtime.protocol import SaveTimings, StepTimings
from trainer_runtime.timings import SaveTimer, StepTimer, percentile


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 99, None),
        ([5.0], 99, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),
        ([float(i) for i in range(1, 101)], 99, 99.0),
        ([float(i) for i in range(1, 101)], 100, 100.0),
        ([3.0, 1.0, 2.0], 0, 1.0),
    ],
)
def test_percentile_nearest_rank(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_step_timer_last_ema_max_p99() -> None:
    timer = StepTimer(ema_alpha=0.5)
    for value in (1.0, 3.0, 2.0):
        timer.record(value)
    assert timer.last == 2.0
    assert timer.ema == pytest.approx((1.0 + 0.5 * 2.0) + 0.5 * (2.0 - 2.0))  # 1 -> 2 -> 2
    assert timer.max == 3.0 and timer.count == 3 and timer.p99 == 3.0
    model = timer.to_model()
    assert model == StepTimings(last=2.0, ema=2.0, p99=3.0, max=3.0, count=3)


def test_step_timer_window_and_reload() -> None:
    timer = StepTimer(window=10)
    for value in [9.0] + [1.0] * 20:  # the slow first step leaves the window
        timer.record(value)
    assert timer.max == 9.0 and timer.p99 == 1.0
    restored = StepTimer()
    restored.load(timer.to_model().model_dump())
    assert restored.max == 9.0 and restored.count == 21 and restored.p99 == 1.0
    restored.record(4.0)
    assert restored.p99 == 4.0 and restored.count == 22


def test_save_timer() -> None:
    timer = SaveTimer()
    assert timer.to_model() == SaveTimings()
    timer.record(2.0)
    timer.record(1.0)
    assert timer.to_model() == SaveTimings(last=1.0, max=2.0, count=2, recent_blocking=[2.0, 1.0])
    again = SaveTimer()
    again.load({"last": 1.0, "max": 2.0, "count": 2, "recent_blocking": [2.0, 1.0]})
    assert again.to_model() == timer.to_model()
    older = SaveTimer()  # a record written before recent_blocking existed
    older.load({"last": 1.0, "max": 2.0, "count": 2})
    assert older.jit_estimate is None and older.max == 2.0


@pytest.mark.parametrize(
    ("saves", "estimate", "maximum"),
    [
        ([], None, None),
        # background writes count for the max (the grace rule), never for the JIT estimate
        ([(9.0, False)], None, 9.0),
        ([(2.0, True), (9.0, False)], 2.0, 9.0),
        # the longest of the last five blocking saves: an old slow one ages out
        ([(30.0, True), *[(1.0, True)] * 5], 1.0, 30.0),
        ([(30.0, True), *[(1.0, True)] * 4], 30.0, 30.0),
        ([(1.0, True), (3.0, True), (2.0, True)], 3.0, 3.0),
    ],
)
def test_jit_estimate_from_recent_blocking_saves(
    saves: list[tuple[float, bool]], estimate: float | None, maximum: float | None
) -> None:
    timer = SaveTimer()
    for seconds, blocking in saves:
        timer.record(seconds, blocking=blocking)
    assert (timer.jit_estimate, timer.max) == (estimate, maximum)
    again = SaveTimer()  # carried across attempts in the checkpoint's record
    again.load(timer.to_model().model_dump())
    assert (again.jit_estimate, again.max, again.count) == (estimate, maximum, len(saves))
