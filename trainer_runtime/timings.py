"""Step and save wall-time measurements: the inputs of the operator's grace rule."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from trainer_runtime.protocol import SaveTimings, StepTimings

__all__ = ["SaveTimer", "StepTimer", "percentile"]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by the nearest-rank rule; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q!r} must be within [0, 100]")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class StepTimer:
    """Last, exponential moving average, p99 (over a window) and max of step wall times.

    The first step includes warm-up (allocations, first collective) and is counted: it is a real
    step the grace period must cover if a SIGTERM arrives during it.
    """

    def __init__(self, ema_alpha: float = 0.1, window: int = 1000) -> None:
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha={ema_alpha!r} must be within (0, 1]")
        self.ema_alpha = ema_alpha
        self.last: float | None = None
        self.ema: float | None = None
        self.max: float | None = None
        self.count = 0
        self._window: deque[float] = deque(maxlen=window)

    def record(self, seconds: float) -> None:
        self.last = seconds
        self.ema = seconds if self.ema is None else self.ema + self.ema_alpha * (seconds - self.ema)
        self.max = seconds if self.max is None else max(self.max, seconds)
        self.count += 1
        self._window.append(seconds)

    @property
    def p99(self) -> float | None:
        return percentile(list(self._window), 99)

    def to_model(self) -> StepTimings:
        return StepTimings(
            last=self.last, ema=self.ema, p99=self.p99, max=self.max, count=self.count
        )

    def load(self, data: dict[str, Any] | StepTimings | None) -> None:
        """Continue from measurements of an earlier attempt (max and EMA carry over)."""
        if data is None:
            return
        model = data if isinstance(data, StepTimings) else StepTimings.model_validate(data)
        self.last, self.ema, self.max, self.count = model.last, model.ema, model.max, model.count
        # The window itself is not persisted; seed it with the old p99 so p99 stays meaningful.
        self._window.clear()
        if model.p99 is not None:
            self._window.append(model.p99)


class SaveTimer:
    """Last and max checkpoint save wall times."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.max: float | None = None
        self.count = 0

    def record(self, seconds: float) -> None:
        self.last = seconds
        self.max = seconds if self.max is None else max(self.max, seconds)
        self.count += 1

    def to_model(self) -> SaveTimings:
        return SaveTimings(last=self.last, max=self.max, count=self.count)

    def load(self, data: dict[str, Any] | SaveTimings | None) -> None:
        if data is None:
            return
        model = data if isinstance(data, SaveTimings) else SaveTimings.model_validate(data)
        self.last, self.max, self.count = model.last, model.max, model.count
