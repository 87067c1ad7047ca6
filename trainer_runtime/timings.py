"""Step and save wall-time measurements: the inputs of the operator's grace rule."""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from trainer_runtime.checkpoint.layout import attempt_from_env
from trainer_runtime.protocol import (
    SaveTimings,
    StepTimings,
    TerminationMessage,
    write_termination_message,
)

__all__ = [
    "SaveTimer",
    "StepTimer",
    "percentile",
    "timings_record",
    "write_termination",
]

logger = logging.getLogger(__name__)


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


# Blocking saves a JIT save's estimate is taken from (the newest ones, earlier attempts included).
RECENT_BLOCKING_SAVES = 5


class SaveTimer:
    """Checkpoint save wall times: last and all-time max (the operator's grace rule takes the
    max), and the last few saves that blocked training (what a JIT save is expected to take)."""

    def __init__(self) -> None:
        self.last: float | None = None
        self.max: float | None = None
        self.count = 0
        self.recent_blocking: list[float] = []

    def record(self, seconds: float, *, blocking: bool = True) -> None:
        """``blocking=False``: a background write, measured while training competed with it for
        CPU and disk: it counts for the max, not for the JIT estimate."""
        self.last = seconds
        self.max = seconds if self.max is None else max(self.max, seconds)
        self.count += 1
        if blocking:
            self.recent_blocking = [*self.recent_blocking, seconds][-RECENT_BLOCKING_SAVES:]

    @property
    def jit_estimate(self) -> float | None:
        """How long a JIT save is expected to take: the longest of the recent blocking saves;
        None before any (then nothing says a save cannot fit). Not the all-time max, so one slow
        save long ago (a cold cache, a slow moment of shared storage) cannot switch JIT saves off
        for good."""
        return max(self.recent_blocking) if self.recent_blocking else None

    def to_model(self) -> SaveTimings:
        return SaveTimings(
            last=self.last,
            max=self.max,
            count=self.count,
            recent_blocking=list(self.recent_blocking),
        )

    def load(self, data: dict[str, Any] | SaveTimings | None) -> None:
        if data is None:
            return
        model = data if isinstance(data, SaveTimings) else SaveTimings.model_validate(data)
        self.last, self.max, self.count = model.last, model.max, model.count
        self.recent_blocking = list(model.recent_blocking)[-RECENT_BLOCKING_SAVES:]


def timings_record(
    step_timer: StepTimer,
    save_timer: SaveTimer,
    sigterm_to_exit: list[float],
    *,
    jit_elapsed: float | None = None,
    micro_batch_timer: StepTimer | None = None,
) -> dict[str, Any]:
    """The measurements a checkpoint carries (``preemptible_state.json``): step and save timings,
    the SIGTERM-to-exit seconds of earlier attempts plus this JIT save's (``jit_elapsed``, measured
    when the record is written, the last file before the commit), and the attempt."""
    exits = list(sigterm_to_exit)
    if jit_elapsed is not None:
        exits.append(round(jit_elapsed, 6))
    extra: dict[str, Any] = {}
    if micro_batch_timer is not None and micro_batch_timer.count:
        extra["micro_batch_seconds"] = micro_batch_timer.to_model().model_dump()
    return {
        **extra,
        "step_seconds": step_timer.to_model().model_dump(),
        "save_seconds": save_timer.to_model().model_dump(),
        "sigterm_to_exit_seconds": exits,
        "attempt": attempt_from_env(),
    }


def write_termination(
    reason: str,
    *,
    step: int,
    checkpoint: Any,
    step_timer: StepTimer,
    save_timer: SaveTimer,
    sigterm_to_exit: float | None = None,
    message: str | None = None,
    micro_batch_timer: StepTimer | None = None,
    stop: str | None = None,
    failed_rank: int | None = None,
    peer_gone: bool | None = None,
    resumed_from: Any = None,
) -> None:
    """Write the pod's termination message (exit protocol); ``checkpoint`` is the last
    checkpoint's info (``path``, ``complete``) or None; ``resumed_from`` the info (``path``,
    ``step``) of the checkpoint the attempt loaded, or None. A write error is logged, never raised:
    the exit code still tells the operator how the run ended."""
    msg = TerminationMessage(
        reason=reason,  # type: ignore[arg-type]
        step=int(step),
        checkpoint=checkpoint.path if checkpoint else None,
        complete=bool(checkpoint and checkpoint.complete),
        attempt=attempt_from_env(),
        step_seconds=step_timer.to_model(),
        save_seconds=save_timer.to_model(),
        sigterm_to_exit_seconds=sigterm_to_exit,
        micro_batch_seconds=micro_batch_timer.to_model()
        if micro_batch_timer is not None and micro_batch_timer.count
        else None,
        stop=stop,
        message=message[:2000] if message else None,
        failed_rank=failed_rank,
        peer_gone=peer_gone,
        resumed_from=resumed_from.path if resumed_from is not None else None,
        resumed_from_step=resumed_from.step if resumed_from is not None else None,
    )
    try:
        write_termination_message(msg)
    except OSError as exc:
        logger.error("cannot write the termination message: %s", exc)
