"""An ended attempt's end step and lost steps come from its own reports only (issue 30)."""

from __future__ import annotations

import pytest

from preemptible_operator.accounting import attempt_end_step, attempt_lost_steps


@pytest.mark.parametrize(
    ("attempt", "start_step", "reported", "progress", "progress_attempt", "expected"),
    [
        # its termination messages
        (2, 100, [150], None, None, 150),
        (2, 100, [150, 149], 140, 2, 150),
        # else its last scraped step
        (2, 100, [], 140, 2, 140),
        # the scraped step higher than the message (a message written before the last steps)
        (2, 100, [130], 140, 2, 140),
        # preempted while loading: progress still shows attempt 1's step -> its start step
        (2, 100, [], 150, 1, 100),
        (2, 100, [], 150, None, 100),  # a status written before the attempt was recorded
        # a fresh first attempt that reported nothing
        (1, 0, [], None, None, 0),
        # nothing known at all (a record rebuilt from a Job without its annotations)
        (3, None, [], 150, 2, None),
        # a message from the loading attempt (the step it resumed at) is its own report
        (2, 100, [100], 150, 1, 100),
    ],
)
def test_end_step_counts_only_the_attempts_own_reports(
    attempt: int,
    start_step: int | None,
    reported: list[int],
    progress: int | None,
    progress_attempt: int | None,
    expected: int | None,
) -> None:
    assert attempt_end_step(attempt, start_step, reported, progress, progress_attempt) == expected


@pytest.mark.parametrize(
    ("end_step", "start_step", "checkpoint_step", "succeeded", "lost"),
    [
        (150, 100, 100, False, 50),  # resumed at 100, reached 150, no newer checkpoint
        (150, 100, 150, False, 0),  # its JIT checkpoint holds everything
        (150, 100, 140, False, 10),
        # preempted while loading: the end step is its start step, nothing lost (attempt 1's
        # 50 lost steps were counted when attempt 1 ended; they are not counted again)
        (100, 100, 100, False, 0),
        # the newest checkpoint is unknown (storage unreadable, no report): only what this
        # attempt did after its start counts, not the earlier attempts' steps
        (150, 100, None, False, 50),
        (30, 0, None, False, 30),
        (150, 100, 100, True, 0),  # a success loses nothing
        (None, 100, 100, False, 0),  # unknown end
        (90, 100, 100, False, 0),  # never below 0
    ],
)
def test_lost_steps_are_those_of_the_attempt(
    end_step: int | None,
    start_step: int | None,
    checkpoint_step: int | None,
    succeeded: bool,
    lost: int,
) -> None:
    assert attempt_lost_steps(end_step, start_step, checkpoint_step, succeeded) == lost


def test_a_preemption_while_loading_does_not_count_lost_steps_twice() -> None:
    """Attempt 1 (from 0) reaches 150 with checkpoint 100: 50 lost. Attempt 2 resumes at 100
    and is preempted while loading; the job's progress still shows 150 (attempt 1's): the old
    rule took 150 as attempt 2's end and counted the same 50 steps again."""
    end1 = attempt_end_step(1, 0, [], 150, 1)
    lost1 = attempt_lost_steps(end1, 0, 100, False)
    end2 = attempt_end_step(2, 100, [], 150, 1)
    lost2 = attempt_lost_steps(end2, 100, 100, False)
    assert (end1, lost1, end2, lost2) == (150, 50, 100, 0)
