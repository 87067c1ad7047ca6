"""What an ended attempt did: its end step and the steps it lost (pure, table-tested).

An attempt is credited only with what it reported itself (its pods' termination messages, the
steps scraped from its rank 0 while it ran). status.progress.step is the job's progress: at the
start of an attempt it still shows the step the previous attempt reached, so an attempt preempted
while it was still loading must not take that step as its own (its steps after the checkpoint
were already counted as lost by the previous attempt).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["attempt_end_step", "attempt_lost_steps"]


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
