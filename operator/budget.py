"""Spread each running job's periodic work over an operator-wide budget (pure, table-tested).

Scraping rank 0's ``/metrics`` and writing progress-only status repeat for every running job.
With a fixed period their total rate grows with the number of jobs: at 500 running jobs and a
5 s poll, 100 scrapes and about 30 status writes a second kept the operator and the API server
busy, and the work that matters (a pod's exit 75, the next attempt's Job) queued behind them.
A budget caps the total: below ``base x budget`` running jobs each job keeps ``base``; above,
every job's period grows so that all of them together stay within the budget.
"""

from __future__ import annotations

__all__ = ["spread_interval"]


def spread_interval(base: float, jobs: int, per_second: float) -> float:
    """Seconds between one job's periodic passes: ``base``, or longer so that ``jobs`` jobs
    together do at most ``per_second`` of them a second. ``per_second`` <= 0: no budget."""
    if per_second <= 0 or jobs <= 0:
        return base
    return max(base, jobs / per_second)
