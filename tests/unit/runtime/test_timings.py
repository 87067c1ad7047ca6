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
    assert timer.to_model() == SaveTimings(last=1.0, max=2.0, count=2)
    again = SaveTimer()
    again.load({"last": 1.0, "max": 2.0, "count": 2})
    assert again.to_model() == timer.to_model()
