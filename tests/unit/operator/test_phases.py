"""The state machine (next_phase) and the restart backoff."""

from __future__ import annotations

import pytest

from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.models import Progress, Timings
from preemptible_operator.phases import (
    PhaseInputs,
    backoff_seconds,
    deadline_remaining,
    estimate_progress,
    next_attempt_number,
    next_phase,
    ttl_remaining,
)

ACTIVE = Interruption("Active", Reason.STARTED)
EVICTED = Interruption("Preempted", Reason.POD_EVICTED, "pod x: evicted")
KUEUE = Interruption("Preempted", Reason.KUEUE_PREEMPTED, "Kueue Evicted (Preempted)")
FAILED = Interruption("Failed", Reason.TRAINING_FAILED, "exit 1")
DONE = Interruption("Succeeded", Reason.COMPLETED)
SUSPENDED = Interruption("Suspended", Reason.SUSPENDED)

CASES = [
    ("new", PhaseInputs(), "Pending", "create_attempt"),
    ("new-but-suspended", PhaseInputs(suspend=True), "Suspended", "none"),
    ("invalid", PhaseInputs(invalid=True, attempt=2), "Failed", "fail_invalid"),
    ("terminal-stays", PhaseInputs(current_phase="Succeeded", invalid=True), "Succeeded", "finish"),
    (
        "queued",
        PhaseInputs(attempt=1, job_exists=True, job_suspended=True, kueue=True, pods=0),
        "Queued",
        "none",
    ),
    ("pods-pending", PhaseInputs(attempt=1, job_exists=True, pods=1), "Pending", "none"),
    ("running", PhaseInputs(attempt=1, job_exists=True, pods=2, running_pods=2), "Running", "none"),
    (
        "job-missing-recreate",
        PhaseInputs(attempt=1, job_exists=False, pods=0),
        "Pending",
        "create_attempt",
    ),
    (
        "evicted-checkpointing",
        PhaseInputs(attempt=1, job_exists=True, pods=1, interruption=EVICTED, pods_finished=False),
        "Checkpointing",
        "none",
    ),
    (
        "kueue-checkpointing-deactivates",
        PhaseInputs(attempt=1, job_exists=True, pods=1, interruption=KUEUE, pods_finished=False),
        "Checkpointing",
        "deactivate_workload",
    ),
    (
        "evicted-pods-gone-record",
        PhaseInputs(attempt=1, job_exists=True, pods=1, interruption=EVICTED, pods_finished=True),
        "Requeueing",
        "record_attempt",
    ),
    (
        "success-record",
        PhaseInputs(attempt=1, job_exists=True, interruption=DONE),
        "Succeeded",
        "record_attempt",
    ),
    (
        "success-ranks-finishing",
        PhaseInputs(attempt=1, job_exists=True, pods=2, interruption=DONE, pods_finished=False),
        "Running",
        "none",
    ),
    (
        "failure-other-ranks-stopping",
        PhaseInputs(attempt=1, job_exists=True, pods=2, interruption=FAILED, pods_finished=False),
        "Running",
        "none",
    ),
    (
        "user-suspend-stops",
        PhaseInputs(
            attempt=1,
            job_exists=True,
            pods=1,
            running_pods=1,
            suspend=True,
            interruption=SUSPENDED,
            pods_finished=False,
        ),
        "Checkpointing",
        "stop_attempt",
    ),
    (
        "user-suspend-recorded",
        PhaseInputs(attempt=1, recorded_outcome="Suspended", suspend=True),
        "Suspended",
        "cleanup",
    ),
    (
        "user-resume",
        PhaseInputs(attempt=1, recorded_outcome="Suspended", suspend=False),
        "Requeueing",
        "create_attempt",
    ),
    (
        # Someone else deactivated the Kueue Workload: the operator set spec.suspend; no new
        # attempt (and no fresh Workload) until the user sets it back to false.
        "workload-deactivated-recorded-stays-suspended",
        PhaseInputs(
            attempt=1,
            recorded_outcome="Suspended",
            recorded_reason=Reason.WORKLOAD_DEACTIVATED,
            suspend=True,
        ),
        "Suspended",
        "cleanup",
    ),
    (
        "workload-deactivated-resumed-by-the-user",
        PhaseInputs(
            attempt=1,
            recorded_outcome="Suspended",
            recorded_reason=Reason.WORKLOAD_DEACTIVATED,
            suspend=False,
        ),
        "Requeueing",
        "create_attempt",
    ),
    (
        # A newer operator (before a rollback) ended the attempt with an outcome this version
        # does not know: the next attempt starts, as after a preemption, and nothing is counted.
        "newer-outcome-recorded-requeue",
        PhaseInputs(attempt=2, recorded_outcome="Resized", failures=0, max_restarts=0),
        "Requeueing",
        "create_attempt",
    ),
    (
        "preempted-recorded-requeue",
        PhaseInputs(attempt=2, recorded_outcome="Preempted"),
        "Requeueing",
        "create_attempt",
    ),
    (
        "preemptions-never-exhaust",
        PhaseInputs(attempt=9, recorded_outcome="Preempted", failures=0, max_restarts=0),
        "Requeueing",
        "create_attempt",
    ),
    (
        "failure-backoff",
        PhaseInputs(
            attempt=1, recorded_outcome="Failed", failures=1, max_restarts=3, backoff_remaining=8.0
        ),
        "Requeueing",
        "wait_backoff",
    ),
    (
        "failure-restart",
        PhaseInputs(attempt=1, recorded_outcome="Failed", failures=1, max_restarts=3),
        "Requeueing",
        "create_attempt",
    ),
    (
        "failure-exhausted",
        PhaseInputs(attempt=4, recorded_outcome="Failed", failures=4, max_restarts=3),
        "Failed",
        "finish",
    ),
    (
        "max-restarts-zero",
        PhaseInputs(attempt=1, recorded_outcome="Failed", failures=1, max_restarts=0),
        "Failed",
        "finish",
    ),
    (
        "succeeded-recorded",
        PhaseInputs(attempt=3, recorded_outcome="Succeeded"),
        "Succeeded",
        "finish",
    ),
]


@pytest.mark.parametrize(
    ("inputs", "phase", "action"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_next_phase(inputs: PhaseInputs, phase: str, action: str) -> None:
    decision = next_phase(inputs)
    assert (decision.phase, decision.action) == (phase, action), decision


@pytest.mark.parametrize(
    ("base", "failures", "expected"),
    [(10, 0, 0), (10, 1, 10), (10, 2, 20), (10, 3, 40), (10, 20, 3600), (0, 3, 0)],
)
def test_backoff_seconds(base: int, failures: int, expected: int) -> None:
    assert backoff_seconds(base, failures) == expected


def test_no_attempt_starts_while_an_earlier_incarnations_pods_run() -> None:
    """A TrainingJob re-created under the same name waits for the old pods (they may still be
    writing their JIT checkpoint to the same storage) before it creates attempt 1."""
    from preemptible_operator.phases import PhaseInputs, next_phase

    waiting = next_phase(PhaseInputs(attempt=0, previous_pods_active=2))
    assert (waiting.action, waiting.reason) == ("none", "PreviousPodsStopping")
    assert next_phase(PhaseInputs(attempt=0)).action == "create_attempt"


@pytest.mark.parametrize(
    ("count", "keep", "kept", "dropped"),
    [
        (0, 20, [], 0),
        (20, 20, list(range(20)), 0),
        (21, 20, list(range(1, 21)), 1),
        (500, 20, list(range(480, 500)), 480),
        (3, 1, [2], 2),  # the current (newest) attempt always stays
    ],
)
def test_bound_attempts(count: int, keep: int, kept: list[int], dropped: int) -> None:
    from preemptible_operator.phases import bound_attempts

    assert bound_attempts(list(range(count)), keep) == (kept, dropped)


def test_pending_shows_why_pods_do_not_run_and_a_rejected_edit_holds() -> None:
    from preemptible_operator.phases import PhaseInputs, next_phase

    stuck = next_phase(
        PhaseInputs(attempt=1, job_exists=True, pods=1, pending_detail="pod p: ImagePullBackOff")
    )
    assert (stuck.phase, stuck.message) == ("Pending", "pod p: ImagePullBackOff")
    # After a preemption, an invalid edit holds the next attempt; the job is not Failed.
    held = next_phase(
        PhaseInputs(attempt=2, recorded_outcome="Preempted", spec_rejected=True, pods=0)
    )
    assert (held.phase, held.action, held.reason) == ("Requeueing", "none", "SpecChangeRejected")


def test_workload_deactivated_reason_is_shown() -> None:
    decision = next_phase(
        PhaseInputs(
            attempt=1,
            recorded_outcome="Suspended",
            recorded_reason=Reason.WORKLOAD_DEACTIVATED,
            suspend=True,
        )
    )
    assert decision.reason == Reason.WORKLOAD_DEACTIVATED
    assert "spec.suspend to false" in decision.message


@pytest.mark.parametrize(
    ("step", "max_steps", "ema", "phase", "percent", "remaining"),
    [
        (None, None, None, "Pending", None, None),
        (0, 1000, None, "Running", 0, None),  # no step time measured yet
        (250, 1000, 2.0, "Running", 25, 1500),
        (999, 1000, 0.3, "Running", 99, 1),  # ceil: never 0 s left before the end
        (250, 1000, 2.0, "Suspended", 25, 1500),  # training time left, not wall-clock
        (1200, 1000, 2.0, "Running", 100, 0),  # a step count past maxSteps
        (10, 0, 2.0, "Running", None, None),  # maxSteps unknown (0)
        (250, 1000, 2.0, "Failed", 25, None),  # it will not finish
        (None, None, None, "Succeeded", 100, 0),
        (400, 1000, 2.0, "Succeeded", 100, 0),  # stopped early by the script: done
    ],
)
def test_estimate_progress(
    step: int | None,
    max_steps: int | None,
    ema: float | None,
    phase: str,
    percent: int | None,
    remaining: int | None,
) -> None:
    progress = Progress(step=step, max_steps=max_steps) if step is not None else None
    timings = Timings(step_seconds_ema=ema) if ema is not None else None
    got = estimate_progress(progress, timings, phase)
    if percent is None and remaining is None:
        assert got is None or (got.progress_percentage, got.estimated_remaining_seconds) == (
            None,
            None,
        )
        return
    assert got is not None
    assert (got.progress_percentage, got.estimated_remaining_seconds) == (percent, remaining)
    assert (got.step, got.max_steps) == (step, max_steps)


_RUNNING = {"attempt": 2, "job_exists": True, "pods": 2, "running_pods": 2}


@pytest.mark.parametrize(
    ("inputs", "phase", "action", "reason"),
    [
        # pods or a Job of an earlier attempt may still run (issue 39): stopped, no create
        (
            PhaseInputs(attempt=2, recorded_outcome="Preempted", earlier_attempts_active=1),
            "Requeueing",
            "stop_previous",
            Reason.PREVIOUS_ATTEMPT_STOPPING,
        ),
        (
            PhaseInputs(
                attempt=2,
                recorded_outcome="Failed",
                max_restarts=3,
                failures=1,
                earlier_attempts_active=2,
            ),
            "Requeueing",
            "stop_previous",
            Reason.PREVIOUS_ATTEMPT_STOPPING,
        ),  # Kueue re-admitted the failed attempt's Job during the backoff
        (
            PhaseInputs(
                attempt=2,
                recorded_outcome="Failed",
                max_restarts=3,
                failures=1,
                backoff_remaining=5.0,
                earlier_attempts_active=2,
            ),
            "Requeueing",
            "wait_backoff",
            Reason.BACKOFF,
        ),  # checked when the create is due
        # an eviction and re-admission the operator never saw (issue 39): the restarted pods
        # are stopped (JIT checkpoint) and the attempt recorded once they are gone
        (
            PhaseInputs(
                **_RUNNING,
                kueue=True,
                pods_finished=False,
                interruption=Interruption("Preempted", Reason.RESUMED_UNSEEN),
            ),
            "Checkpointing",
            "stop_attempt",
            Reason.RESUMED_UNSEEN,
        ),
        (
            PhaseInputs(
                **_RUNNING,
                pods_finished=True,
                interruption=Interruption("Preempted", Reason.RESUMED_UNSEEN),
            ),
            "Requeueing",
            "record_attempt",
            Reason.RESUMED_UNSEEN,
        ),
        # activeDeadlineSeconds: whatever the job is doing, once it passed the job fails; a
        # running attempt is first stopped the normal way (JIT checkpoint) and recorded
        (
            PhaseInputs(
                **_RUNNING, pods_finished=False, active_deadline_seconds=60, deadline_remaining=0.0
            ),
            "Checkpointing",
            "stop_attempt",
            Reason.DEADLINE_EXCEEDED,
        ),
        (
            PhaseInputs(
                attempt=1, job_exists=True, pods=1, pods_finished=False, deadline_remaining=-5.0
            ),
            "Checkpointing",
            "stop_attempt",
            Reason.DEADLINE_EXCEEDED,
        ),  # stuck Pending
        (
            PhaseInputs(
                attempt=2,
                job_exists=True,
                pods=2,
                pods_finished=True,
                interruption=Interruption("Suspended", Reason.DEADLINE_EXCEEDED),
                deadline_remaining=-5.0,
            ),
            "Failed",
            "record_attempt",
            Reason.DEADLINE_EXCEEDED,
        ),  # its pods are gone: recorded, and the job is over in the same pass
        (
            PhaseInputs(attempt=1, job_exists=True, job_suspended=True, deadline_remaining=-5.0),
            "Failed",
            "record_attempt",
            Reason.DEADLINE_EXCEEDED,
        ),  # queued, never admitted: recorded (its Job goes with the record)
        (
            PhaseInputs(
                attempt=2,
                job_exists=True,
                pods=2,
                interruption=Interruption("Succeeded", Reason.COMPLETED),
                deadline_remaining=-5.0,
            ),
            "Succeeded",
            "record_attempt",
            Reason.COMPLETED,
        ),  # training finished just before the deadline: a success
        (
            PhaseInputs(attempt=2, recorded_outcome="Succeeded", deadline_remaining=-5.0),
            "Succeeded",
            "finish",
            Reason.COMPLETED,
        ),
        (
            PhaseInputs(attempt=2, recorded_outcome="Suspended", deadline_remaining=-5.0),
            "Failed",
            "fail",
            Reason.DEADLINE_EXCEEDED,
        ),  # the stopped attempt is recorded: the job is over
        (
            PhaseInputs(attempt=3, recorded_outcome="Preempted", deadline_remaining=-1.0),
            "Failed",
            "fail",
            Reason.DEADLINE_EXCEEDED,
        ),  # between attempts
        (
            PhaseInputs(
                attempt=1, suspend=True, recorded_outcome="Suspended", deadline_remaining=-1
            ),
            "Failed",
            "fail",
            Reason.DEADLINE_EXCEEDED,
        ),  # suspended: the clock runs on
        (
            PhaseInputs(**_RUNNING, deadline_remaining=30.0),
            "Running",
            "none",
            Reason.STARTED,
        ),
        (
            PhaseInputs(current_phase="Succeeded", deadline_remaining=-100.0),
            "Succeeded",
            "finish",
            Reason.COMPLETED,
        ),  # a finished job stays finished
        # maxPreemptions: the preemption past the limit fails the job instead of a requeue
        (
            PhaseInputs(attempt=3, recorded_outcome="Preempted", preemptions=3, max_preemptions=2),
            "Failed",
            "finish",
            Reason.PREEMPTION_LIMIT_EXCEEDED,
        ),
        (
            PhaseInputs(attempt=1, recorded_outcome="Preempted", preemptions=1, max_preemptions=0),
            "Failed",
            "finish",
            Reason.PREEMPTION_LIMIT_EXCEEDED,
        ),
        (
            PhaseInputs(attempt=3, recorded_outcome="Preempted", preemptions=2, max_preemptions=2),
            "Requeueing",
            "create_attempt",
            Reason.REQUEUED,
        ),
        (
            PhaseInputs(attempt=9, recorded_outcome="Preempted", preemptions=8),
            "Requeueing",
            "create_attempt",
            Reason.REQUEUED,
        ),  # no limit
        (
            PhaseInputs(
                attempt=3,
                recorded_outcome="Suspended",
                preemptions=5,
                max_preemptions=2,
            ),
            "Requeueing",
            "create_attempt",
            Reason.RESUMED,
        ),  # a resume is no preemption
    ],
)
def test_deadline_and_preemption_limit(
    inputs: PhaseInputs, phase: str, action: str, reason: str
) -> None:
    decision = next_phase(inputs)
    assert (decision.phase, decision.action, decision.reason) == (phase, action, reason)
    if reason == Reason.PREEMPTION_LIMIT_EXCEEDED:
        assert f"maxPreemptions is {inputs.max_preemptions}" in decision.message
    if reason == Reason.DEADLINE_EXCEEDED:
        assert "activeDeadlineSeconds" in decision.message
        # Raising the deadline of a job that is over does nothing: never advised.
        assert "raise" not in decision.message


@pytest.mark.parametrize(
    ("start", "deadline", "now", "left"),
    [
        (None, 60, 1_000.0, None),  # no attempt yet: the clock has not started
        ("1970-01-01T00:10:00Z", None, 1_000.0, None),  # no deadline
        ("1970-01-01T00:10:00Z", 600, 1_000.0, 200.0),
        ("1970-01-01T00:10:00Z", 600, 1_300.0, -100.0),
    ],
)
def test_deadline_remaining(
    start: str | None, deadline: int | None, now: float, left: float | None
) -> None:
    assert deadline_remaining(start, deadline, now) == left


@pytest.mark.parametrize(
    ("phase", "completed", "ttl", "now", "left"),
    [
        ("Running", None, 60, 1_000.0, None),  # not finished: no TTL clock
        ("Failed", "1970-01-01T00:10:00Z", None, 1_000.0, None),  # no TTL: kept
        ("Succeeded", "1970-01-01T00:10:00Z", 600, 1_000.0, 200.0),
        ("Failed", "1970-01-01T00:10:00Z", 300, 1_000.0, -100.0),  # due: delete now
        ("Succeeded", "1970-01-01T00:10:00Z", 0, 600.0, 0.0),  # 0: at once
        ("Succeeded", None, 60, 1_000.0, None),  # no completion time recorded
    ],
)
def test_ttl_remaining(
    phase: str, completed: str | None, ttl: int | None, now: float, left: float | None
) -> None:
    assert ttl_remaining(phase, completed, ttl, now) == left


@pytest.mark.parametrize(
    ("attempt", "recorded", "expected"),
    [(0, False, 1), (0, True, 1), (1, True, 2), (3, False, 3), (3, True, 4)],
)
def test_next_attempt_number(attempt: int, recorded: bool, expected: int) -> None:
    """The one rule for the attempt a create makes (issue 39: it was repeated)."""
    assert next_attempt_number(attempt, recorded) == expected
