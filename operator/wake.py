"""When the next pass of one TrainingJob is due (pure): its TTL, what the pass asked for, the
periodic timer (budget.periodic_delay) and activeDeadlineSeconds
(tests/unit/operator/test_wake.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from preemptible_operator.phases import TERMINAL_PHASES, ttl_remaining

__all__ = [
    "Wake",
    "deadline_wake",
    "wake_after",
]


@dataclass(frozen=True)
class Wake:
    """When the next pass is due, before the periodic timer and the deadline."""

    delete: bool = False
    """spec.ttlSecondsAfterFinished passed: delete the TrainingJob, no further pass."""
    done: bool = False
    """Terminal and nothing due: no further pass for this object."""
    requeue_after: float | None = None
    periodic: bool = False
    """Nothing due: the periodic timer (budget.periodic_delay) decides."""
    busy: bool = False
    """The attempt's pods exist in a phase where time matters (scraping, lost nodes): on the
    poll timer, whose budget is shared among such jobs."""


def wake_after(
    phase: str,
    completion_time: str | None,
    ttl: int | None,
    due: float | None,
    has_pods: bool,
    now: float,
) -> Wake:
    """``due``: what the pass asked for (None: nothing). A finished job wakes when its TTL runs
    out; watch events wake the next pass otherwise, a timer only where time itself matters."""
    ttl_left = ttl_remaining(phase, completion_time, ttl, now)
    if ttl_left is not None and ttl_left <= 0:
        return Wake(delete=True, done=True)
    if ttl_left is not None:
        due = ttl_left if due is None else min(due, ttl_left)
    if phase in TERMINAL_PHASES and due is None:
        return Wake(done=True)
    if due is None:
        busy = has_pods and phase in ("Running", "Checkpointing", "Pending")
        return Wake(periodic=True, busy=busy)
    return Wake(requeue_after=due)


def deadline_wake(due: float | None, phase: str, deadline_left: float | None) -> float | None:
    """Wake at activeDeadlineSeconds even when nothing else happens (a job stuck Pending, a
    queued one with no timer of its own)."""
    if phase in TERMINAL_PHASES or deadline_left is None:
        return due
    at_deadline = max(0.5, deadline_left + 0.5)
    return at_deadline if due is None else min(due, at_deadline)
