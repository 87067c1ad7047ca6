"""Spread each running job's periodic work over an operator-wide budget (pure, table-tested).

Scraping rank 0's ``/metrics`` and writing progress-only status repeat for every running job.
With a fixed period their total rate grows with the number of jobs: at 500 running jobs and a
5 s poll, 100 scrapes and about 30 status writes a second kept the operator and the API server
busy, and the work that matters (a pod's exit 75, the next attempt's Job) queued behind them.
A budget caps the total: below ``base x budget`` running jobs each job keeps ``base``; above,
every job's period grows so that all of them together stay within the budget.
"""

from __future__ import annotations

__all__ = ["periodic_delay", "spread_interval"]


def spread_interval(base: float, jobs: int, per_second: float) -> float:
    """Seconds between one job's periodic passes: ``base``, or longer so that ``jobs`` jobs
    together do at most ``per_second`` of them a second. ``per_second`` <= 0: no budget."""
    if per_second <= 0 or jobs <= 0:
        return base
    return max(base, jobs / per_second)


def periodic_delay(phase: str | None, busy: bool, poll: float, idle_resync: float) -> float | None:
    """Seconds until a job's next periodic pass after a pass that asked for none (None: no
    timer at all; watch events wake it). ``busy``: its attempt's pods exist, so time itself
    matters (scraping rank 0, pods on a node that may be lost): ``poll``. Queued: nothing
    changes but by events the operator watches (Kueue's admission unsuspends the Job; an
    eviction or a deactivation changes the Workload), and thousands of jobs may wait in a
    queue, so no timer. Else a safety-net pass every ``idle_resync`` seconds."""
    if busy:
        return poll
    if phase == "Queued":
        return None
    return idle_resync
