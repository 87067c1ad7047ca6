"""What an ended attempt did: its end step and the steps it lost (pure, table-tested).

An attempt is credited only with what it reported itself (its pods' termination messages, the
steps scraped from its rank 0 while it ran). status.progress.step is the job's progress: at the
start of an attempt it still shows the step the previous attempt reached, so an attempt preempted
while it was still loading must not take that step as its own (its steps after the checkpoint
were already counted as lost by the previous attempt).

An attempt whose pods left no termination message (a kill at the grace deadline, the OOM killer, a
runtime without a SIGTERM handler) reported its last step only through /metrics, scraped every so
often: the steps it did after that scrape are estimated from the scrape's time, the step rate
measured between this attempt's scrapes and the time its training stopped (its container's end,
or SIGTERM plus the runtime's kill wait when it was asked to stop). When its pods left no end
either (a lost node: no terminated state, the pod deleted), the time it stopped lies between its
last answered scrape and the first unanswered one after it (``unreachableSince``): the middle of
that span. The record says it is an estimate (``lostStepsEstimated``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = [
    "RATE_WINDOW_SECONDS",
    "STAMP_MIDDLE",
    "attempt_end_step",
    "attempt_lost_steps",
    "attempt_ran",
    "estimated_end_step",
    "limited_preemptions",
    "lost_contact_stopped_at",
    "step_rate",
    "training_stopped_at",
]


def attempt_end_step(
    attempt: int,
    start_step: int | None,
    reported_steps: Iterable[int],
    progress_step: int | None,
    progress_attempt: int | None,
) -> int | None:
    """The last step attempt ``attempt`` reached: the highest of its termination messages' steps
    and of the scraped step when that scrape was its own (``progress_attempt``); when it reported
    nothing, its ``start_step`` (it did no step; None when that is unknown too)."""
    own = list(reported_steps)
    if progress_step is not None and progress_attempt == attempt:
        own.append(progress_step)
    return max(own) if own else start_step


def attempt_lost_steps(
    end_step: int | None,
    start_step: int | None,
    checkpoint_step: int | None,
    succeeded: bool,
) -> int:
    """Steps the attempt computed that no complete checkpoint holds: ``end_step`` minus the newer
    of the newest complete checkpoint and the step it started from (steps before its start were
    done, and counted, by earlier attempts). 0 for a success or an unknown end."""
    if succeeded or end_step is None:
        return 0
    return max(0, end_step - max(checkpoint_step or 0, start_step or 0))


RATE_WINDOW_SECONDS = 60.0
"""Time constant of the step rate's moving average: a save between two scrapes close together
(no step done) must not make the rate 0."""


def step_rate(
    previous: tuple[int, float] | None,
    current: tuple[int, float],
    previous_rate: float | None,
    step_seconds: float | None,
    window: float = RATE_WINDOW_SECONDS,
) -> float | None:
    """Steps per second of one attempt's training, from two of its scrapes ``(step, time)``:
    ``previous`` (None: this is the attempt's first) and ``current``, averaged with the
    attempt's ``previous_rate`` by the time between them (``window``: the rate's time constant).
    Saves and data loading between the scrapes are in it, as they are in the steps an estimate
    extrapolates over. When the two cannot give a rate (no earlier scrape, no time between them,
    the step went back: a restarted process), ``previous_rate``, else ``1 / step_seconds`` (the
    runtime's own step time), else None."""
    if previous is not None:
        (step0, t0), (step1, t1) = previous, current
        if t1 > t0 and step1 >= step0:
            pair = (step1 - step0) / (t1 - t0)
            if previous_rate is None:
                return pair
            weight = 1.0 - math.exp(-(t1 - t0) / window)
            return weight * pair + (1.0 - weight) * previous_rate
    if previous_rate is not None:
        return previous_rate
    if step_seconds is not None and step_seconds > 0:
        return 1.0 / step_seconds
    return None


STAMP_MIDDLE = 0.5
"""finishedAt and deletionTimestamp are written with one second's resolution, truncated."""


def training_stopped_at(
    finished_at: float | None, sigterm_to_exit: float | None, kill_wait: float
) -> float | None:
    """When rank 0 stopped training steps: its container's end, or, when it was asked to stop
    (a deletion: SIGTERM ``sigterm_to_exit`` seconds before its end), no later than SIGTERM plus
    the runtime's ``kill_wait`` (it trains on that long, then stops or saves: a pod killed at its
    grace deadline spent the rest of it saving, not stepping). None when its end is unknown (a
    lost node: no terminated state). The pod's stamps are whole seconds, cut short: the middle
    of that second is the estimate (half a second is a step of a fast job)."""
    if finished_at is None:
        return None
    if sigterm_to_exit is None:
        return finished_at + STAMP_MIDDLE
    return min(finished_at, finished_at - sigterm_to_exit + kill_wait) + STAMP_MIDDLE


def lost_contact_stopped_at(
    last_answered: float | None, unreachable_since: float | None, ended: float
) -> float | None:
    """When rank 0 stopped training on a node that was lost (no terminated state, so no end
    time of its own): it still answered its last scrape (``last_answered``, a lower bound) and
    no longer the first scrape after it (``unreachable_since``, an upper bound; ``ended``, when
    the operator saw the attempt end, is one too). The middle of the two bounds: the smallest
    worst-case error (half the time between two scrapes). None when a bound is unknown (never
    scraped, or no scrape failed before its pods were gone)."""
    if last_answered is None or unreachable_since is None:
        return None
    upper = min(unreachable_since, ended)
    if upper <= last_answered:
        return last_answered
    return (last_answered + upper) / 2.0


def estimated_end_step(
    last_step: int | None,
    last_time: float | None,
    rate: float | None,
    stopped_at: float | None,
    max_steps: int | None = None,
) -> int | None:
    """The step an attempt that left no message reached: its last scraped step plus the steps
    at ``rate`` from that scrape (``last_time``) to ``stopped_at``, rounded, never beyond
    ``max_steps``. Just ``last_step`` when a term is unknown."""
    if last_step is None:
        return None
    if last_time is None or rate is None or stopped_at is None or not math.isfinite(rate):
        return last_step
    more = round(max(0.0, stopped_at - last_time) * max(0.0, rate))
    end = last_step + more
    return min(end, max_steps) if max_steps else end


# ------------------------------------------------------------------------- maxPreemptions
def attempt_ran(
    running_time: str | None,
    containers_started: bool,
    end_step: int | None,
    start_step: int | None,
) -> bool:
    """Whether an ended attempt ran: the operator saw all its pods run together
    (``running_time``), a training container started (its terminated state has a start, or it
    left a termination message), or it got past the step it resumed from. A workload Kueue
    evicted while its pods were still pending did none of these."""
    return (
        running_time is not None
        or containers_started
        or (end_step is not None and end_step > (start_step or 0))
    )


def limited_preemptions(preemptions: int | None, before_running: int | None) -> int:
    """The preemptions spec.maxPreemptions limits: those of attempts that ran (a job preempted
    in a loop is one whose work keeps being interrupted; an attempt evicted before it started
    interrupted nothing, status.preemptionsBeforeRunning)."""
    return max(0, (preemptions or 0) - (before_running or 0))
