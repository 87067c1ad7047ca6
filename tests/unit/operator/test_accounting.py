"""An ended attempt's end step and lost steps come from its own reports only (issue 30)."""

from __future__ import annotations

import math

import pytest

from preemptible_operator import models
from preemptible_operator.accounting import (
    attempt_end_step,
    attempt_lost_steps,
    attempt_ran,
    estimated_end_step,
    limited_preemptions,
    lost_contact_stopped_at,
    step_rate,
    training_stopped_at,
)
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.observation import phase_inputs
from preemptible_operator.phases import next_phase
from tests.unit.operator.builders import make_snapshot, make_spec


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


# ------------------------------------------------ the estimate for an attempt without a message


@pytest.mark.parametrize(
    ("previous", "current", "previous_rate", "step_seconds", "expected"),
    [
        # two scrapes of the attempt: their rate (saves between them included)
        ((100, 0.0), (120, 10.0), None, 0.25, 2.0),
        # averaged with the attempt's rate by the time between them (60 s time constant)
        ((100, 0.0), (100, 60.0), 2.0, None, 2.0 * math.exp(-1.0)),
        ((100, 0.0), (160, 30.0), 2.0, None, 2.0),
        # no earlier scrape of this attempt: its rate so far, else the runtime's step time
        (None, (5, 3.0), 1.5, 0.25, 1.5),
        (None, (5, 3.0), None, 0.25, 4.0),
        (None, (5, 3.0), None, None, None),
        (None, (5, 3.0), None, 0.0, None),  # the runtime's 0 before its first step
        # the same instant, or a step that went back (a restarted process): no new rate
        ((100, 5.0), (110, 5.0), 1.0, None, 1.0),
        ((100, 0.0), (90, 10.0), None, 0.5, 2.0),
    ],
)
def test_step_rate(
    previous: tuple[int, float] | None,
    current: tuple[int, float],
    previous_rate: float | None,
    step_seconds: float | None,
    expected: float | None,
) -> None:
    rate = step_rate(previous, current, previous_rate, step_seconds)
    assert rate == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(
    ("finished_at", "sigterm_to_exit", "kill_wait", "expected"),
    [
        (1000.0, None, 3.0, 1000.5),  # OOM kill, a crash: it trained until its end
        (1000.0, 30.0, 3.0, 973.5),  # SIGKILLed at a 30 s grace: saving after SIGTERM + 3 s
        (1000.0, 1.0, 3.0, 1000.5),  # no SIGTERM handler: died at once
        (1000.0, 0.0, 0.0, 1000.5),
        (None, 30.0, 3.0, None),  # a lost node: no end known
    ],
)  # the stamps are whole seconds, truncated: + 0.5 s, their middle
def test_training_stopped_at(
    finished_at: float | None, sigterm_to_exit: float | None, kill_wait: float, expected: float
) -> None:
    assert training_stopped_at(finished_at, sigterm_to_exit, kill_wait) == expected


@pytest.mark.parametrize(
    ("last_answered", "unreachable_since", "ended", "expected"),
    [
        # answered at 1000, not at 1001.2: stopped in between, at the middle
        (1000.0, 1001.2, 1060.0, 1000.6),
        # the operator was down between the two scrapes: a wide span, still its middle
        (1000.0, 1010.0, 1060.0, 1005.0),
        # the attempt was seen ended before the failed scrape's time: the end is the bound
        (1000.0, 1010.0, 1002.0, 1001.0),
        (1000.0, 1000.0, 1060.0, 1000.0),  # no time between them
        (1000.0, 999.0, 1060.0, 1000.0),  # clocks out of order: never before the answer
        # a bound unknown: no estimate (never scraped, no scrape failed before the pods went)
        (None, 1001.0, 1060.0, None),
        (1000.0, None, 1060.0, None),
    ],
)
def test_lost_contact_stopped_at(
    last_answered: float | None,
    unreachable_since: float | None,
    ended: float,
    expected: float | None,
) -> None:
    """A lost node's pod leaves no end: its training stopped between its last answered scrape
    and the first unanswered one (issue 39, finding 5)."""
    got = lost_contact_stopped_at(last_answered, unreachable_since, ended)
    assert got == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(
    ("last_step", "last_time", "rate", "stopped_at", "max_steps", "expected"),
    [
        # 20.4 s after the last scrape at 2.5 steps/s: 51 more steps
        (100, 1000.0, 2.5, 1020.4, None, 151),
        (100, 1000.0, 2.5, 1020.4, 120, 120),  # never past maxSteps
        (100, 1000.0, 2.5, 990.0, None, 100),  # stopped before the scrape was written: none
        (100, 1000.0, 0.0, 1020.0, None, 100),
        # a term unknown: the last scrape itself
        (100, None, 2.5, 1020.0, None, 100),
        (100, 1000.0, None, 1020.0, None, 100),
        (100, 1000.0, 2.5, None, None, 100),
        (100, 1000.0, math.inf, 1020.0, None, 100),
        (None, 1000.0, 2.5, 1020.0, None, None),  # never scraped
    ],
)
def test_estimated_end_step(
    last_step: int | None,
    last_time: float | None,
    rate: float | None,
    stopped_at: float | None,
    max_steps: int | None,
    expected: int | None,
) -> None:
    assert estimated_end_step(last_step, last_time, rate, stopped_at, max_steps) == expected


# ------------------------------------------------------------------------- maxPreemptions
@pytest.mark.parametrize(
    ("running_time", "started", "end_step", "start_step", "ran"),
    [
        (None, False, 100, 100, False),  # evicted while its pods were pending
        (None, False, None, None, False),
        ("2026-05-28T20:26:40Z", False, 100, 100, True),  # seen running, preempted at once
        (None, True, 100, 100, True),  # a container started between two passes
        (None, False, 104, 100, True),  # scraped past its start
        (None, False, 3, None, True),
    ],
)
def test_attempt_ran(
    running_time: str | None, started: bool, end_step: int | None, start_step: int | None, ran: bool
) -> None:
    assert attempt_ran(running_time, started, end_step, start_step) is ran


@pytest.mark.parametrize(
    ("preemptions", "before_running", "expected"),
    [(None, None, 0), (3, None, 3), (3, 2, 1), (2, 2, 0), (1, 5, 0)],
)
def test_limited_preemptions(
    preemptions: int | None, before_running: int | None, expected: int
) -> None:
    assert limited_preemptions(preemptions, before_running) == expected


def test_max_preemptions_does_not_count_attempts_that_never_ran() -> None:
    """Three preemptions, two of them of attempts evicted before their pods started: with
    maxPreemptions 1 the job is requeued, not failed (issue 39, finding 7)."""
    record = models.AttemptRecord(
        attempt=3, job_name="tj-a3", outcome="Preempted", reason=Reason.KUEUE_PREEMPTED
    )
    status = models.TrainingJobStatus(
        attempt=3, attempts=[record], preemptions=3, preemptions_before_running=2
    )
    spec = make_spec(maxPreemptions=1)
    snap = make_snapshot(spec=spec, status=status, attempt=3)
    inputs = phase_inputs(snap, status, record, True, Interruption("Active", Reason.STARTED), 0.0)
    assert inputs.preemptions == 1
    decision = next_phase(inputs)
    assert decision.reason != Reason.PREEMPTION_LIMIT_EXCEEDED
