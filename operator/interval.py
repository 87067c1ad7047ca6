"""The checkpoint interval that minimises the expected lost time (pure, table-tested).

With checkpoints every ``T`` seconds, each costing ``C`` seconds to save, and preemptions arriving
on average every ``M`` seconds of running, a preemption loses on average half an interval of work
(the work since the last checkpoint) while saving costs ``C / T`` of the time. The sum
``C / T + T / (2 M)`` is smallest at ``T = sqrt(2 C M)`` (Young, 1974; Daly's refinement differs
only when C is not small next to M). Before the first preemption (or the first save) nothing is
known, so nothing is recommended.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from preemptible_operator import models
from preemptible_operator.timestamps import parse_rfc3339

__all__ = [
    "IntervalRecommendation",
    "auto_save_interval",
    "interval_status",
    "preemption_window",
    "recommend_interval",
    "running_seconds",
]

# Never recommend saving more often than every 30 s: below that the save itself dominates and the
# measurements are too noisy to act on.
MIN_INTERVAL_SECONDS = 30


@dataclass(frozen=True)
class IntervalRecommendation:
    """``seconds``: the recommended interval (None: not enough observations); the inputs."""

    seconds: int | None
    save_seconds: float | None
    mean_time_between_preemptions: float | None
    running_seconds: float
    preemptions: int
    reason: str


def running_seconds(spans: Iterable[tuple[float | None, float | None]], now: float) -> float:
    """Total seconds the attempts ran: each (running since, ended at) span; an attempt still
    running counts until ``now``; one that never ran counts 0."""
    total = 0.0
    for start, end in spans:
        if start is None:
            continue
        total += max(0.0, (end if end is not None else now) - start)
    return total


def recommend_interval(
    save_seconds: float | None,
    running: float,
    preemptions: int,
    *,
    minimum: int = MIN_INTERVAL_SECONDS,
) -> IntervalRecommendation:
    """``ceil(sqrt(2 * save_seconds * running / preemptions))``, at least ``minimum``."""
    if preemptions <= 0:
        return IntervalRecommendation(
            None, save_seconds, None, running, preemptions, "no preemption observed yet"
        )
    if save_seconds is None or save_seconds <= 0 or not math.isfinite(save_seconds):
        return IntervalRecommendation(
            None, save_seconds, None, running, preemptions, "no checkpoint save measured yet"
        )
    if running <= 0:
        return IntervalRecommendation(
            None, save_seconds, None, running, preemptions, "no running time observed yet"
        )
    mtbp = running / preemptions
    raw = math.sqrt(2.0 * save_seconds * mtbp)
    seconds = max(minimum, math.ceil(raw))
    reason = (
        f"sqrt(2 x {save_seconds:.3g} s save x {mtbp:.4g} s between preemptions "
        f"({preemptions} in {running:.4g} s of running)) = {raw:.4g} s"
    )
    if minimum > raw:
        reason += f"; raised to the minimum {minimum} s"
    return IntervalRecommendation(seconds, save_seconds, mtbp, running, preemptions, reason)


def preemption_window(attempts: Iterable[models.AttemptRecord], now: float) -> tuple[float, int]:
    """(running seconds, preemptions) over the same attempts: the ended ones among the kept
    records. Both come from one window: status.preemptions counts every attempt ever, while only
    the newest records (phases.MAX_ATTEMPT_RECORDS) keep their running time, so dividing the one
    by the other would shrink the mean time between preemptions with every record dropped (200
    hourly preemptions: 20 h / 200 = 6 min instead of 1 h). A preemption counts when its attempt
    ran (it interrupted running work; one preempted while queued lost nothing and ran 0 s).
    Ended attempts only: the status then changes when an attempt ends, not on every pass."""
    running = 0.0
    preemptions = 0
    for a in attempts:
        if not a.end_time:
            continue
        start = parse_rfc3339(a.running_time)
        running += running_seconds([(start, parse_rfc3339(a.end_time))], now)
        if a.outcome == "Preempted" and start is not None:
            preemptions += 1
    return running, preemptions


def interval_status(
    status: models.TrainingJobStatus, spec: models.TrainingJobSpec, now: float
) -> tuple[models.CheckpointIntervalStatus, str | None]:
    """status.checkpointInterval from the attempts and save timings; and an event message when
    the recommendation is new or moved by 10 % or more (None otherwise). The rate is that of the
    ended attempts among the kept records (``preemption_window``)."""
    running, preemptions = preemption_window(status.attempts or [], now)
    t = status.timings or models.Timings()
    save = t.save_seconds_last or t.save_seconds_max
    rec = recommend_interval(save, running, preemptions)
    new = models.CheckpointIntervalStatus(
        recommended_seconds=rec.seconds,
        save_seconds=None if rec.save_seconds is None else round(rec.save_seconds, 3),
        mean_time_between_preemptions_seconds=None
        if rec.mean_time_between_preemptions is None
        else round(rec.mean_time_between_preemptions, 1),
        running_seconds=round(rec.running_seconds, 1),
        preemptions=rec.preemptions,
        applied=spec.checkpoint.interval == "auto",
        reason=rec.reason,
    )
    old = status.checkpoint_interval.recommended_seconds if status.checkpoint_interval else None
    message = None
    if rec.seconds is not None and (old is None or abs(rec.seconds - old) >= 0.1 * old):
        message = f"save a checkpoint every {rec.seconds} s: {rec.reason}" + (
            " (applied to the next attempt: spec.checkpoint.interval is auto)"
            if new.applied
            else " (set spec.checkpoint.interval: auto to apply it)"
        )
    elif old is not None and rec.seconds is not None:
        # Small drift: keep the announced value, so the status does not churn every pass.
        new.recommended_seconds = old
    return new, message


def auto_save_interval(
    spec: models.TrainingJobSpec, status: models.TrainingJobStatus
) -> int | None:
    """The interval a new attempt gets: the recommendation when spec.checkpoint.interval is auto."""
    if spec.checkpoint.interval != "auto" or status.checkpoint_interval is None:
        return None
    return status.checkpoint_interval.recommended_seconds
