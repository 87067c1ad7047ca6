"""The reconcile pass's decisions (decide.py): snapshot and status in, what changes out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models, render
from preemptible_operator.children import Refusal
from preemptible_operator.classify import DEACTIVATED_BY_OPERATOR_ANNOTATION, Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.decide import (
    DEACTIVATE_ON_RECORD,
    action_status,
    adopted_params,
    attempt_created_message,
    awaits_pods,
    by_attempt,
    clear_refused,
    current_record,
    deactivation_patch,
    deadline_wake,
    earlier_attempts_active,
    find_record,
    grace_status,
    held_pods,
    interruption_of,
    left_by_earlier_incarnation,
    no_pods_wait,
    owned_children,
    pass_spec,
    phase_change_event,
    phase_conditions,
    phase_inputs,
    plan_attempt,
    pods_refusal,
    refusal_outcome,
    rejected_message,
    shown_phase,
    start_attempt,
    starts_now,
    status_message,
    unreachable_condition,
    wake_after,
)
from preemptible_operator.phases import Decision, PhaseInputs
from preemptible_operator.resume import attempt_fence
from preemptible_operator.victims import BOOST_ANNOTATION
from tests.unit.operator.builders import cond, make_job, make_pod, make_snapshot, make_spec

T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z
T0_RFC = "2026-05-28T20:26:40Z"
ACTIVE = Interruption("Active", Reason.STARTED)


def _wl(*conds: dict[str, Any], active: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": "wl"},
        "spec": {"active": active},
        "status": {"conditions": list(conds)},
    }


def _record(**fields: Any) -> models.AttemptRecord:
    return models.AttemptRecord(**{"attempt": 1, "job_name": "tj-a1", **fields})


# ------------------------------------------------------------------------------ starts_now
STARTS = [
    # (id, completions, pods, record, started now)
    ("all-pods-running", 2, [make_pod("a", index=0), make_pod("b", index=1)], _record(), True),
    (
        "one-of-two-pending",
        2,
        [make_pod("a", index=0), make_pod("b", index=1, phase="Pending", node=None)],
        _record(),
        False,
    ),
    ("already-started", 1, [make_pod()], _record(running_time=T0_RFC), False),
    ("no-record", 1, [make_pod()], None, False),
    ("no-pods", 1, [], _record(), False),
]


@pytest.mark.parametrize(
    ("completions", "pods", "record", "expected"),
    [c[1:] for c in STARTS],
    ids=[c[0] for c in STARTS],
)
def test_starts_now(
    completions: int,
    pods: list[dict[str, Any]],
    record: models.AttemptRecord | None,
    expected: bool,
) -> None:
    snap = make_snapshot(attempt=1, job=make_job(completions=completions), pods=pods)
    assert starts_now(snap, make_spec(), record) is expected


def test_starts_now_without_completions_counts_the_spec_nodes() -> None:
    """A Job without spec.completions (not yet defaulted): spec.numNodes pods must run."""
    job = make_job()
    del job["spec"]["completions"]
    snap = make_snapshot(attempt=1, job=job, pods=[make_pod("a", index=0)])
    assert starts_now(snap, make_spec(numNodes=2), _record()) is False
    assert starts_now(snap, make_spec(numNodes=1), _record()) is True


# ------------------------------------------------------------------------------ interruption_of
INTERRUPTIONS = [
    # (id, snapshot fields, spec fields, record, recorded, outcome, reason, deactivated_by_other)
    ("no-attempt", {}, {}, None, False, "Active", Reason.STARTED, False),
    (
        "recorded-is-not-reclassified",
        {"attempt": 1, "job": make_job(), "pods": [make_pod(phase="Failed", exit_code=1)]},
        {},
        _record(end_time=T0_RFC),
        True,
        "Active",
        Reason.STARTED,
        False,
    ),
    (
        "running",
        {"attempt": 1, "job": make_job(), "pods": [make_pod()]},
        {},
        _record(running_time=T0_RFC),
        False,
        "Active",
        Reason.STARTED,
        False,
    ),
    (
        "trainer-failed",
        {"attempt": 1, "job": make_job(), "pods": [make_pod(phase="Failed", exit_code=1)]},
        {},
        _record(running_time=T0_RFC),
        False,
        "Failed",
        Reason.TRAINING_FAILED,
        False,
    ),
    (
        # The Job was deleted under running pods: an eviction under Kueue, a failure without.
        "job-deleted-kueue",
        {"attempt": 1, "job": None, "pods": [make_pod()]},
        {"queueName": "q"},
        _record(running_time=T0_RFC),
        False,
        "Preempted",
        Reason.KUEUE_EVICTED,
        False,
    ),
    (
        "job-deleted-no-kueue",
        {"attempt": 1, "job": None, "pods": [make_pod()]},
        {},
        _record(running_time=T0_RFC),
        False,
        "Preempted",
        Reason.JOB_FAILED,
        False,
    ),
    (
        # Someone else deactivated the Workload: the pass suspends the TrainingJob.
        "workload-deactivated-by-other",
        {
            "attempt": 1,
            "job": make_job(suspend=True),
            "workload": _wl(cond("Evicted", "InactiveWorkload"), active=False),
        },
        {"queueName": "q"},
        _record(running_time=T0_RFC),
        False,
        "Suspended",
        Reason.WORKLOAD_DEACTIVATED,
        True,
    ),
    (
        # The user suspended already: nothing to suspend, the attempt is just over.
        "workload-deactivated-user-suspended",
        {
            "attempt": 1,
            "job": make_job(suspend=True),
            "workload": _wl(cond("Evicted", "InactiveWorkload"), active=False),
        },
        {"queueName": "q", "suspend": True},
        _record(running_time=T0_RFC),
        False,
        "Suspended",
        Reason.WORKLOAD_DEACTIVATED,
        False,
    ),
]


@pytest.mark.parametrize(
    ("snap_fields", "spec_fields", "record", "recorded", "outcome", "reason", "by_other"),
    [c[1:] for c in INTERRUPTIONS],
    ids=[c[0] for c in INTERRUPTIONS],
)
def test_interruption_of(
    snap_fields: dict[str, Any],
    spec_fields: dict[str, Any],
    record: models.AttemptRecord | None,
    recorded: bool,
    outcome: str,
    reason: str,
    by_other: bool,
) -> None:
    spec = make_spec(**spec_fields)
    snap = make_snapshot(spec=spec, **snap_fields)
    seen = interruption_of(snap, spec, record, recorded)
    assert (seen.interruption.outcome, seen.interruption.reason) == (outcome, reason)
    assert seen.deactivated_by_other is by_other


@pytest.mark.parametrize(
    ("pods", "suspend", "outcome", "reason"),
    [
        ([make_pod()], False, "Suspended", Reason.DEADLINE_EXCEEDED),  # running: stopped
        ([make_pod(phase="Failed", exit_code=75)], False, "Suspended", Reason.DEADLINE_EXCEEDED),
        ([make_pod(phase="Failed", exit_code=137)], False, "Suspended", Reason.DEADLINE_EXCEEDED),
        ([make_pod()], True, "Suspended", Reason.DEADLINE_EXCEEDED),  # the deadline wins
        ([make_pod(phase="Succeeded", exit_code=0)], False, "Succeeded", Reason.COMPLETED),
    ],
    ids=["running", "jit-exit", "killed", "suspended-too", "finished-first"],
)
def test_interruption_of_after_the_deadline(
    pods: list[dict[str, Any]], suspend: bool, outcome: str, reason: str
) -> None:
    """activeDeadlineSeconds passed: the operator stops the attempt, which then ends for the
    deadline (recorded like a suspension: no preemption, no failure), unless it finished."""
    spec = make_spec(activeDeadlineSeconds=60, suspend=suspend)
    snap = make_snapshot(spec=spec, attempt=1, job=make_job(), pods=pods)
    seen = interruption_of(snap, spec, _record(running_time=T0_RFC), False, True)
    assert (seen.interruption.outcome, seen.interruption.reason) == (outcome, reason)
    assert not seen.deactivated_by_other
    if reason == Reason.DEADLINE_EXCEEDED:
        assert "activeDeadlineSeconds (60)" in seen.interruption.message


def _at(pod: dict[str, Any], created: str, *, deleted: bool = False) -> dict[str, Any]:
    pod["metadata"]["creationTimestamp"] = created
    if deleted:
        pod["metadata"]["deletionTimestamp"] = created
    return pod


_OLD_75 = "2026-01-01T00:00:00Z"
_NEW = "2026-01-01T00:10:00Z"


@pytest.mark.parametrize(
    ("queue", "pods", "outcome", "reason"),
    [
        # Evicted and re-admitted while the operator was down: the old pod (exit 75, held by
        # the attempt finalizer) and a new pod of the same index, running from the old resume.
        (
            "q",
            [
                _at(make_pod("a", phase="Failed", exit_code=75), _OLD_75, deleted=True),
                _at(make_pod("b"), _NEW),
            ],
            "Preempted",
            Reason.RESUMED_UNSEEN,
        ),
        (
            None,
            [
                _at(make_pod("a", phase="Failed", exit_code=75), _OLD_75, deleted=True),
                _at(make_pod("b", phase="Pending", node=None), _NEW),
            ],
            "Preempted",
            Reason.RESUMED_UNSEEN,
        ),
        # Two ranks, one failed first, the other still stopping: nothing restarted.
        (
            "q",
            [
                _at(make_pod("a", phase="Failed", exit_code=1), _OLD_75),
                _at(make_pod("b", index=1), _NEW),
            ],
            "Failed",
            Reason.TRAINING_FAILED,
        ),
    ],
    ids=["kueue", "no-kueue-pending", "other-rank-failed"],
)
def test_interruption_of_a_resume_never_seen(
    queue: str | None, pods: list[dict[str, Any]], outcome: str, reason: str
) -> None:
    spec = make_spec(queueName=queue) if queue else make_spec()
    job = make_job(completions=2 if len({p["metadata"]["name"] for p in pods}) > 1 else 1)
    snap = make_snapshot(spec=spec, attempt=1, job=job, pods=pods, workload=_wl(cond("Admitted")))
    seen = interruption_of(snap, spec, _record(running_time=T0_RFC), False)
    assert (seen.interruption.outcome, seen.interruption.reason) == (outcome, reason)


def test_interruption_of_without_a_spec_is_active() -> None:
    """A rejected spec with no attempt spec at hand: nothing is classified."""
    snap = make_snapshot(spec=None, attempt=1, pods=[make_pod(phase="Failed", exit_code=1)])
    assert interruption_of(snap, None, _record(), False).interruption == ACTIVE


# ------------------------------------------------------------------------------ phase_inputs
def test_phase_inputs_reads_the_snapshot_and_status() -> None:
    spec = make_spec(
        queueName="q",
        maxRestarts=4,
        maxPreemptions=7,
        activeDeadlineSeconds=600,
        failurePolicy={"restartWindowSeconds": 3600},
    )
    unschedulable = cond("PodScheduled", "Unschedulable", "0/3 nodes fit", status="False")
    pods = [
        make_pod("a", index=0),
        make_pod("b", index=1, phase="Pending", node=None, conditions=[unschedulable]),
    ]
    status = models.TrainingJobStatus(
        phase="Running",
        start_time="2026-05-28T20:21:40Z",  # 300 s before T0
        next_attempt_after="2026-05-28T20:26:50Z",  # 10 s after T0
        failures=3,
        # One failure inside the window, one outside: one counted of three in total.
        failure_times=["2026-05-28T19:00:00Z", "2026-05-28T20:00:00Z"],
        preemptions=2,
    )
    snap = make_snapshot(
        spec=spec,
        status=status,
        attempt=2,
        job=make_job(completions=2, suspend=True),
        pods=pods,
        previous_pods=[make_pod("old")],
    )
    record = _record(attempt=2, outcome="Failed", reason=Reason.TRAINING_FAILED)
    got = phase_inputs(snap, status, record, False, ACTIVE, T0)
    assert got.current_phase == "Running" and got.attempt == 2
    assert (got.job_exists, got.job_suspended, got.kueue) == (True, True, True)
    # Not recorded: the record's outcome is not the attempt's yet.
    assert (got.recorded_outcome, got.recorded_reason) == (None, None)
    assert (got.pods, got.running_pods, got.pods_finished) == (2, 1, False)
    assert got.pending_detail == "pod b: Unschedulable: 0/3 nodes fit"
    assert got.previous_pods_active == 1
    assert got.backoff_remaining == pytest.approx(10.0)
    assert got.deadline_remaining == pytest.approx(300.0)
    assert (got.max_restarts, got.max_preemptions, got.preemptions) == (4, 7, 2)
    assert (got.failures, got.restart_window_seconds) == (1, 3600)
    recorded = phase_inputs(snap, status, record, True, ACTIVE, T0)
    assert (recorded.recorded_outcome, recorded.recorded_reason) == (
        "Failed",
        Reason.TRAINING_FAILED,
    )


INPUT_FLAGS = [
    # (id, snapshot fields, invalid, suspend, spec_rejected)
    ("valid", {}, False, False, False),
    ("invalid-name", {"invalid": "name too long"}, True, False, False),
    ("suspended", {"spec": make_spec(suspend=True)}, False, True, False),
    # An invalid edit after the job ran, with the attempt's spec at hand: the attempt goes on
    # with it, but the next one is held until the spec is fixed (issue 39).
    ("rejected-with-attempt-spec", {"rejected": "bad", "attempt": 1}, False, False, True),
    ("rejected-no-spec", {"rejected": "bad", "spec": None, "attempt": 1}, False, False, True),
]


@pytest.mark.parametrize(
    ("fields", "invalid", "suspend", "rejected"),
    [c[1:] for c in INPUT_FLAGS],
    ids=[c[0] for c in INPUT_FLAGS],
)
def test_phase_inputs_flags(
    fields: dict[str, Any], invalid: bool, suspend: bool, rejected: bool
) -> None:
    snap = make_snapshot(**fields)
    got = phase_inputs(snap, snap.status, None, False, ACTIVE, T0)
    assert (got.invalid, got.suspend, got.spec_rejected) == (invalid, suspend, rejected)
    assert got.backoff_remaining == 0.0 and got.deadline_remaining is None


def test_backoff_past_is_zero() -> None:
    status = models.TrainingJobStatus(next_attempt_after="2026-05-28T20:00:00Z")
    snap = make_snapshot(status=status)
    assert phase_inputs(snap, status, None, False, ACTIVE, T0).backoff_remaining == 0.0


def test_find_record() -> None:
    status = models.TrainingJobStatus(attempts=[_record(attempt=1), _record(attempt=3)])
    assert find_record(status, 3) is status.attempts[1]  # type: ignore[index]
    assert find_record(status, 2) is None
    assert find_record(models.TrainingJobStatus(), 1) is None


# ------------------------------------------------------------------------------ refusals
def _conditions(ctype: str, status: str, reason: str = "", message: str = "") -> Any:
    return conds.set_condition(None, ctype, status, reason, message, "2026-05-28T20:00:00Z", 1)  # type: ignore[arg-type]


REFUSED = _conditions(conds.CREATE_REFUSED, "True", Reason.CHILD_FORBIDDEN, "quota")


@pytest.mark.parametrize(
    ("before", "expected"),
    [
        (None, None),
        (REFUSED, "False"),
        (_conditions(conds.CREATE_REFUSED, "False", Reason.CREATED), "False"),
    ],
    ids=["none", "refused-cleared", "already-clear"],
)
def test_clear_refused(before: Any, expected: str | None) -> None:
    after = clear_refused(before, T0_RFC, 2)
    found = conds.find_condition(after, conds.CREATE_REFUSED)
    assert (found.status if found else None) == expected
    if before is not None and before[0].status == "False":
        assert after is before  # nothing to change: the same list


PENDING = Decision("Pending", "none", Reason.STARTED)
AWAITS = [
    # (id, decision, spec, job, recorded, awaits)
    ("pending-job-running", PENDING, make_spec(), make_job(), False, True),
    ("queued-job-suspended", PENDING, make_spec(), make_job(suspend=True), False, False),
    ("no-job", PENDING, make_spec(), None, False, False),
    ("recorded", PENDING, make_spec(), make_job(), True, False),
    ("no-spec", PENDING, None, make_job(), False, False),
    ("running", Decision("Running", "none", Reason.STARTED), make_spec(), make_job(), False, False),
    (
        "creating",
        Decision("Pending", "create_attempt", Reason.STARTED),
        make_spec(),
        make_job(),
        False,
        False,
    ),
]


@pytest.mark.parametrize(
    ("decision", "spec", "job", "recorded", "expected"),
    [c[1:] for c in AWAITS],
    ids=[c[0] for c in AWAITS],
)
def test_awaits_pods(
    decision: Decision,
    spec: models.TrainingJobSpec | None,
    job: dict[str, Any] | None,
    recorded: bool,
    expected: bool,
) -> None:
    assert awaits_pods(decision, spec, job, recorded) is expected


def _failed_create(message: str, at: str) -> dict[str, Any]:
    return {"reason": "FailedCreate", "message": message, "lastTimestamp": at}


@pytest.mark.parametrize(
    ("events", "job_conditions", "message"),
    [
        ([], [], None),
        (
            [
                _failed_create("old", "2026-01-01T00:00:00Z"),
                _failed_create("quota", "2026-01-02T00:00:00Z"),
            ],
            [],
            "the Job controller cannot create the pods of Job tj-a1: quota",
        ),
        (
            [],
            [cond("ReplicaFailure", "FailedCreate", "forbidden: PSA")],
            "the Job controller cannot create the pods of Job tj-a1: forbidden: PSA",
        ),
    ],
    ids=["nothing-said", "newest-event", "job-condition"],
)
def test_pods_refusal(
    events: list[dict[str, Any]], job_conditions: list[dict[str, Any]], message: str | None
) -> None:
    got = pods_refusal(make_job(conditions=job_conditions), events)
    if message is None:
        assert got is None
        return
    assert got == Refusal(Reason.PODS_REFUSED, message, fatal=False)


@pytest.mark.parametrize(
    ("created", "wait"),
    [
        (None, 5.0),
        ("2026-05-28T20:26:38Z", 5.0),
        ("2026-05-28T20:25:40Z", 60.0),
        ("2026-05-28T10:00:00Z", 300.0),
    ],
    ids=["unknown-age", "new", "a-minute", "hours"],
)
def test_no_pods_wait_backs_off_with_the_job_age(created: str | None, wait: float) -> None:
    job = make_job()
    if created is not None:
        job["metadata"]["creationTimestamp"] = created
    assert no_pods_wait(job, T0) == pytest.approx(wait)


FORBIDDEN = Refusal(Reason.CHILD_FORBIDDEN, "quota", fatal=False)
INVALID = Refusal(Reason.CHILD_INVALID, "Job tj-a1 is invalid", fatal=True)
REFUSALS = [
    # (id, conditions before, refusal, phase, event, requeue_after)
    ("new-temporary", None, FORBIDDEN, "Pending", True, 5.0),
    # Refused since 20:00:00, 1600 s before T0: retried at the cap.
    ("same-again", REFUSED, FORBIDDEN, "Pending", False, 300.0),
    (
        "says-something-new",
        REFUSED,
        Refusal(Reason.CHILD_FORBIDDEN, "other quota", fatal=False),
        "Pending",
        True,
        300.0,
    ),
    ("fatal", None, INVALID, "Failed", True, None),
]


@pytest.mark.parametrize(
    ("before", "refusal", "phase", "event", "requeue"),
    [c[1:] for c in REFUSALS],
    ids=[c[0] for c in REFUSALS],
)
def test_refusal_outcome(
    before: Any, refusal: Refusal, phase: str, event: bool, requeue: float | None
) -> None:
    got = refusal_outcome(before, refusal, PENDING, T0_RFC, 3, T0)
    found = conds.find_condition(got.conditions, conds.CREATE_REFUSED)
    assert found is not None and (found.status, found.reason, found.message) == (
        "True",
        refusal.reason,
        refusal.message,
    )
    assert got.decision == Decision(phase, "none", refusal.reason, refusal.message)  # type: ignore[arg-type]
    assert got.event == (("Warning", refusal.reason, refusal.message) if event else None)
    assert got.requeue_after == (pytest.approx(requeue) if requeue is not None else None)


# ------------------------------------------------------------------------------ unreachable nodes
NOT_READY_SINCE = T0 - 1000
UNREACHABLE = [
    # (id, pods, node ready, recorded, conditions before, status after, event)
    ("stuck-past-bound", [make_pod()], {"node-1": False}, False, None, "True", True),
    (
        "still-stuck",
        [make_pod()],
        {"node-1": False},
        False,
        _conditions(conds.NODE_UNREACHABLE, "True", Reason.OUT_OF_SERVICE_NEEDED),
        "True",
        False,
    ),
    (
        "recorded-clears",
        [make_pod()],
        {"node-1": False},
        True,
        _conditions(conds.NODE_UNREACHABLE, "True", Reason.OUT_OF_SERVICE_NEEDED),
        "False",
        False,
    ),
    (
        "node-back",
        [make_pod()],
        {"node-1": True},
        False,
        _conditions(conds.NODE_UNREACHABLE, "True", Reason.OUT_OF_SERVICE_NEEDED),
        "False",
        False,
    ),
    ("never-stuck", [make_pod()], {"node-1": True}, False, None, None, False),
]


@pytest.mark.parametrize(
    ("pods", "ready", "recorded", "before", "after", "event"),
    [c[1:] for c in UNREACHABLE],
    ids=[c[0] for c in UNREACHABLE],
)
def test_unreachable_condition(
    pods: list[dict[str, Any]],
    ready: dict[str, bool],
    recorded: bool,
    before: Any,
    after: str | None,
    event: bool,
) -> None:
    spec = make_spec(unreachableNode={"escalateAfterSeconds": 600})
    since = {n: NOT_READY_SINCE for n, ok in ready.items() if not ok}
    snap = make_snapshot(
        spec=spec, attempt=1, pods=pods, node_ready=ready, node_not_ready_since=since
    )
    got, ev = unreachable_condition(snap, spec, before, recorded, T0_RFC, 1, T0)
    found = conds.find_condition(got, conds.NODE_UNREACHABLE)
    assert (found.status if found else None) == after
    assert (ev is not None and ev[:2] == ("Warning", Reason.OUT_OF_SERVICE_NEEDED)) is event


# ------------------------------------------------------------------------------ grace period
GRACE = [
    # (id, attempts, timings, current grace, cap, status, reason, recommended, event)
    ("no-attempt", [], None, None, None, "True", Reason.NOT_MEASURED, 300, False),
    (
        "running-covered",
        [_record(grace_seconds=120)],
        models.Timings(step_seconds_max=2.0, save_seconds_max=5.0),
        120,
        None,
        "True",
        Reason.GRACE_SUFFICIENT,
        None,
        False,
    ),
    (
        "running-short",
        [_record(grace_seconds=5)],
        models.Timings(step_seconds_max=20.0, save_seconds_max=50.0),
        5,
        None,
        "False",
        Reason.GRACE_TOO_SHORT,
        None,
        True,
    ),
    (
        "killed-at-grace",
        [_record(grace_seconds=30, killed=True, end_time=T0_RFC)],
        None,
        30,
        None,
        "False",
        Reason.GRACE_KILLED,
        60,
        True,
    ),
    (
        "killed-capped",
        [_record(grace_seconds=30, killed=True, end_time=T0_RFC)],
        None,
        30,
        40,
        "False",
        Reason.GRACE_KILLED,
        40,
        True,
    ),
    (
        "deadline-too-short",
        [_record(end_time=T0_RFC, reason=Reason.DEADLINE_TOO_SHORT, message="10 s left")],
        None,
        30,
        None,
        "False",
        Reason.DEADLINE_TOO_SHORT,
        None,
        True,
    ),
]


@pytest.mark.parametrize(
    ("attempts", "timings", "current", "cap", "ok", "reason", "recommended", "event"),
    [c[1:] for c in GRACE],
    ids=[c[0] for c in GRACE],
)
def test_grace_status(
    attempts: list[models.AttemptRecord],
    timings: models.Timings | None,
    current: int | None,
    cap: int | None,
    ok: str,
    reason: str,
    recommended: int | None,
    event: bool,
) -> None:
    status = models.TrainingJobStatus(
        attempts=attempts or None,
        timings=timings,
        grace_period=models.GraceStatus(current=current),
    )
    before = status.model_copy(deep=True)
    got = grace_status(status, make_spec(), cap, T0_RFC, 1)
    assert status == before  # pure: the status passed in is not changed
    found = conds.find_condition(got.conditions, conds.GRACE_PERIOD_SUFFICIENT)
    assert found is not None and (found.status, found.reason) == (ok, reason)
    assert got.grace_period.current == current
    assert got.grace_period.recommended == got.recommended
    if recommended is not None:
        assert got.recommended == recommended
    assert (got.event is not None and got.event[:2] == ("Warning", reason)) is event
    # The same outcome again: no second Event.
    status.conditions = got.conditions
    assert grace_status(status, make_spec(), cap, T0_RFC, 1).event is None


# ------------------------------------------------------------------------------ phase shown
CREATE = Decision("Pending", "create_attempt", Reason.STARTED, "first attempt")
SHOWN = [
    # (id, decision, spec fields, current phase, shown action, new phase)
    # The attempt just created shows what the next pass sees: its Job, no pods yet.
    ("create-shows-pending", CREATE, {}, None, "none", "Pending"),
    ("create-under-kueue-shows-queued", CREATE, {"queueName": "q"}, None, "none", "Queued"),
    (
        "running-stays",
        Decision("Running", "none", Reason.STARTED),
        {},
        "Running",
        "none",
        "Running",
    ),
]


@pytest.mark.parametrize(
    ("decision", "spec_fields", "current", "action", "phase"),
    [c[1:] for c in SHOWN],
    ids=[c[0] for c in SHOWN],
)
def test_shown_phase(
    decision: Decision, spec_fields: dict[str, Any], current: str | None, action: str, phase: str
) -> None:
    spec = make_spec(**spec_fields)
    inputs = PhaseInputs(kueue=bool(spec.queue_name))
    shown, new_phase = shown_phase(decision, inputs, spec, 1, current)
    assert (shown.action, new_phase) == (action, phase)


def test_shown_phase_without_a_spec_shows_the_decision() -> None:
    shown, phase = shown_phase(CREATE, PhaseInputs(), None, 1, "Preempted")
    assert shown == CREATE and phase == "Pending"
    # The follow-up is no plain wait (the deadline passed meanwhile): the create itself is
    # shown, in Queued under Kueue when it changes the phase.
    late = PhaseInputs(kueue=True, active_deadline_seconds=10, deadline_remaining=-1.0)
    spec = make_spec(queueName="q", activeDeadlineSeconds=10)
    shown, phase = shown_phase(CREATE, late, spec, 2, "Preempted")
    assert shown == CREATE and phase == "Queued"
    shown, phase = shown_phase(CREATE, late, make_spec(activeDeadlineSeconds=10), 2, "Preempted")
    assert shown == CREATE and phase == "Pending"


def _status_of(conditions: Any, ctype: str) -> tuple[str, str] | None:
    found = conds.find_condition(conditions, ctype)
    return (found.status, found.reason) if found else None


PHASE_CONDITIONS = [
    # (id, phase, decision, before, expected (type, status, reason) present)
    (
        "queued",
        "Queued",
        Decision("Queued", "none", Reason.QUEUED, "waiting for quota"),
        None,
        [(conds.ADMITTED, "False", Reason.QUEUED), (conds.RUNNING, "False", Reason.QUEUED)],
    ),
    (
        "running-resumes-a-preempted",
        "Running",
        Decision("Running", "none", Reason.STARTED),
        _conditions(conds.PREEMPTED, "True", Reason.KUEUE_PREEMPTED),
        [
            (conds.ADMITTED, "True", Reason.ADMITTED),
            (conds.RUNNING, "True", Reason.STARTED),
            (conds.PREEMPTED, "False", Reason.RESUMED),
        ],
    ),
    (
        "succeeded",
        "Succeeded",
        Decision("Succeeded", "finish", Reason.COMPLETED),
        None,
        [(conds.SUCCEEDED, "True", Reason.COMPLETED), (conds.COMPLETE, "True", Reason.COMPLETED)],
    ),
    (
        "failed-keeps-its-first-reason",
        "Failed",
        Decision("Failed", "finish", Reason.RESTARTS_EXHAUSTED),
        _conditions(conds.FAILED, "True", Reason.INVALID_SPEC),
        [(conds.FAILED, "True", Reason.INVALID_SPEC)],
    ),
    (
        "suspended",
        "Suspended",
        Decision("Suspended", "none", Reason.SUSPENDED),
        None,
        [(conds.SUSPENDED, "True", Reason.SUSPENDED)],
    ),
]


@pytest.mark.parametrize(
    ("phase", "decision", "before", "expected"),
    [c[1:] for c in PHASE_CONDITIONS],
    ids=[c[0] for c in PHASE_CONDITIONS],
)
def test_phase_conditions(
    phase: str, decision: Decision, before: Any, expected: list[tuple[str, str, str]]
) -> None:
    after = phase_conditions(before, phase, decision, T0_RFC, 1)
    for ctype, status, reason in expected:
        assert _status_of(after, ctype) == (status, reason), ctype


EVENTS = [
    # (id, old phase, new phase, decision, events so far, expected)
    ("unchanged", "Running", "Running", Decision("Running", "none", Reason.STARTED), [], None),
    (
        "changed",
        "Pending",
        "Running",
        Decision("Running", "none", Reason.STARTED),
        [],
        ("Normal", Reason.STARTED, "phase Pending -> Running"),
    ),
    (
        "failed-with-message",
        "Running",
        "Failed",
        Decision("Failed", "fail", Reason.DEADLINE_EXCEEDED, "past 600 s"),
        [],
        ("Warning", Reason.DEADLINE_EXCEEDED, "past 600 s"),
    ),
    ("create-posts-its-own", None, "Pending", CREATE, [], None),
    (
        "same-reason-posted-already",
        "Running",
        "Failed",
        Decision("Failed", "finish", Reason.RESTARTS_EXHAUSTED, "x"),
        [("Warning", Reason.RESTARTS_EXHAUSTED, "x")],
        None,
    ),
    (
        "first-phase",
        None,
        "Suspended",
        Decision("Suspended", "none", Reason.SUSPENDED),
        [],
        ("Normal", Reason.SUSPENDED, "phase - -> Suspended"),
    ),
]


@pytest.mark.parametrize(
    ("old", "new", "decision", "events", "expected"),
    [c[1:] for c in EVENTS],
    ids=[c[0] for c in EVENTS],
)
def test_phase_change_event(
    old: str | None,
    new: str,
    decision: Decision,
    events: list[tuple[str, str, str]],
    expected: tuple[str, str, str] | None,
) -> None:
    assert phase_change_event(old, new, decision, events) == expected


MESSAGES = [
    # (id, current, shown, decision, new phase, invalid, expected)
    (
        "shown-message",
        "old",
        Decision("Queued", "none", Reason.QUEUED, "no quota"),
        None,
        "Queued",
        None,
        "no quota",
    ),
    (
        "invalid-spec",
        "old",
        Decision("Failed", "fail_invalid", Reason.INVALID_SPEC, "summary"),
        None,
        "Failed",
        "spec.numNodes: must be >= 1",
        "spec.numNodes: must be >= 1",
    ),
    (
        "succeeded",
        "old",
        Decision("Succeeded", "finish", Reason.COMPLETED, "x"),
        None,
        "Succeeded",
        None,
        "training finished",
    ),
    (
        "running-clears",
        "old",
        Decision("Running", "none", Reason.STARTED),
        None,
        "Running",
        None,
        None,
    ),
    (
        "otherwise-kept",
        "old",
        Decision("Pending", "none", Reason.STARTED),
        None,
        "Pending",
        None,
        "old",
    ),
]


@pytest.mark.parametrize(
    ("current", "shown", "decision", "phase", "invalid", "expected"),
    [c[1:] for c in MESSAGES],
    ids=[c[0] for c in MESSAGES],
)
def test_status_message(
    current: str | None,
    shown: Decision,
    decision: Decision | None,
    phase: str,
    invalid: str | None,
    expected: str | None,
) -> None:
    assert status_message(current, shown, decision or shown, phase, invalid) == expected


def test_rejected_message() -> None:
    assert rejected_message("bad", True) == (
        "spec change rejected (the running attempt goes on with its spec, no new attempt "
        "until it is fixed): bad"
    )
    assert rejected_message("bad", False) == "spec change rejected (no new attempt): bad"


# ------------------------------------------------------------------------------ next pass
WAKES = [
    # (id, phase, completed at, ttl, due, has pods, expected wake)
    (
        "ttl-passed",
        "Succeeded",
        "2026-05-28T20:00:00Z",
        60,
        None,
        False,
        (True, True, None, False, False),
    ),
    (
        "ttl-ahead",
        "Failed",
        "2026-05-28T20:26:00Z",
        60,
        None,
        False,
        (False, False, 20.0, False, False),
    ),
    (
        "ttl-ahead-sooner-due",
        "Failed",
        "2026-05-28T20:26:00Z",
        60,
        1.0,
        False,
        (False, False, 1.0, False, False),
    ),
    ("terminal-no-ttl", "Succeeded", T0_RFC, None, None, False, (False, True, None, False, False)),
    (
        "terminal-releasing",
        "Succeeded",
        T0_RFC,
        None,
        1.0,
        False,
        (False, False, 1.0, False, False),
    ),
    ("running-periodic-busy", "Running", None, None, None, True, (False, False, None, True, True)),
    ("queued-periodic-idle", "Queued", None, None, None, False, (False, False, None, True, False)),
    (
        "suspended-with-pods-idle",
        "Suspended",
        None,
        None,
        None,
        True,
        (False, False, None, True, False),
    ),
    ("due-given", "Pending", None, None, 0.0, True, (False, False, 0.0, False, False)),
]


@pytest.mark.parametrize(
    ("phase", "completed", "ttl", "due", "has_pods", "expected"),
    [c[1:] for c in WAKES],
    ids=[c[0] for c in WAKES],
)
def test_wake_after(
    phase: str,
    completed: str | None,
    ttl: int | None,
    due: float | None,
    has_pods: bool,
    expected: tuple[bool, bool, float | None, bool, bool],
) -> None:
    wake = wake_after(phase, completed, ttl, due, has_pods, T0)
    got = (wake.delete, wake.done, wake.requeue_after, wake.periodic, wake.busy)
    assert got == (
        expected[0],
        expected[1],
        pytest.approx(expected[2]) if expected[2] is not None else None,
        expected[3],
        expected[4],
    )


@pytest.mark.parametrize(
    ("due", "phase", "left", "expected"),
    [
        (None, "Pending", None, None),
        (None, "Queued", 100.0, 100.5),
        (5.0, "Running", 100.0, 5.0),
        (None, "Running", -30.0, 0.5),
        (None, "Failed", 100.0, None),
        (3.0, "Succeeded", -1.0, 3.0),
    ],
    ids=["no-deadline", "queued-wakes-at-it", "sooner-due", "passed", "terminal", "terminal-due"],
)
def test_deadline_wake(
    due: float | None, phase: str, left: float | None, expected: float | None
) -> None:
    assert deadline_wake(due, phase, left) == expected


# ------------------------------------------------------------------------------ current record
def _annotated_job(**ann: str) -> dict[str, Any]:
    job = make_job()
    job["metadata"]["annotations"] = ann
    job["metadata"]["creationTimestamp"] = T0_RFC
    return job


def test_current_record_found() -> None:
    status = models.TrainingJobStatus(attempts=[_record()], next_attempt_after=T0_RFC)
    assert current_record(status, 1, make_job()) is status.attempts[0]  # type: ignore[index]
    assert status.next_attempt_after == T0_RFC  # nothing rebuilt, nothing changed
    assert current_record(models.TrainingJobStatus(), 0, make_job()) is None
    assert current_record(models.TrainingJobStatus(), 1, None) is None


def test_current_record_rebuilt_from_the_job() -> None:
    """The pass that created the Job crashed before writing the status."""
    status = models.TrainingJobStatus(next_attempt_after=T0_RFC)
    job = _annotated_job(
        **{
            render.ANNOTATION_GRACE: "45",
            render.ANNOTATION_START_STEP: "12",
            render.ANNOTATION_RESUME_FROM: "/ckpt/run/checkpoint-12",
        }
    )
    record = current_record(status, 2, job)
    assert record is not None and status.attempts == [record]
    assert (record.attempt, record.job_name, record.start_time) == (2, "tj-a1", T0_RFC)
    assert (record.grace_seconds, record.start_step) == (45, 12)
    assert record.resume_from == "/ckpt/run/checkpoint-12"
    assert status.next_attempt_after is None
    assert status.grace_period is not None and status.grace_period.current == 45


@pytest.mark.parametrize(
    ("start_time", "expected"),
    [(None, T0_RFC), ("2025-12-31T00:00:00Z", "2025-12-31T00:00:00Z")],
    ids=["lost-start-time-from-the-job", "kept"],
)
def test_current_record_rebuilt_sets_the_start_time(start_time: str | None, expected: str) -> None:
    """The operator died between creating attempt 1's Job and writing the status: the job's
    start (activeDeadlineSeconds counts from it) is the Job's creation, never left unset."""
    status = models.TrainingJobStatus(start_time=start_time)
    assert current_record(status, 1, _annotated_job()) is not None
    assert status.start_time == expected


def _named_job(attempt: int, **kw: Any) -> dict[str, Any]:
    job = make_job(**kw)
    job["metadata"]["name"] = f"tj-a{attempt}"
    job["metadata"]["uid"] = f"job-{attempt}"
    return job


def _deleting(job: dict[str, Any]) -> dict[str, Any]:
    job["metadata"]["deletionTimestamp"] = T0_RFC
    return job


@pytest.mark.parametrize(
    ("jobs", "pods", "next_attempt", "active"),
    [
        ({}, {}, 1, (0, 0)),
        # the recorded attempt: its pods ended, its Job failed (exit 75 is FailJob)
        (
            {1: _named_job(1, conditions=[cond("Failed", "PodFailurePolicy")])},
            {1: [make_pod(phase="Failed", exit_code=75)]},
            2,
            (0, 0),
        ),
        # a stale cache: its Job still runs a pod the recorded attempt never showed
        (
            {1: _named_job(1)},
            {1: [make_pod(phase="Failed", exit_code=75), make_pod("b")]},
            2,
            (1, 1),  # and its Job, which can start more
        ),
        # Kueue admitted the failed attempt's Job again during the backoff (not yet deleted)
        ({1: _named_job(1, completions=2)}, {}, 2, (0, 1)),
        ({1: _deleting(_named_job(1, completions=2))}, {}, 2, (0, 0)),  # being deleted
        # a failed pod whose tracking finalizer was stripped, being deleted: still running
        ({}, {1: [make_pod(deleting=True)]}, 2, (1, 0)),
        # the current attempt's own pods and Job are not "earlier" for its re-create
        ({2: _named_job(2)}, {2: [make_pod()]}, 2, (0, 0)),
    ],
    ids=["none", "ended", "stale-cache", "readmitted", "deleting", "stripped", "current"],
)
def test_earlier_attempts_active(
    jobs: dict[int, Any], pods: dict[int, Any], next_attempt: int, active: tuple[int, int]
) -> None:
    snap = make_snapshot(attempt=next_attempt, jobs=jobs, pods_by_attempt=pods)
    got_pods, got_jobs = earlier_attempts_active(snap, next_attempt)
    assert (len(got_pods), len(got_jobs)) == active


# ------------------------------------------------------------------------------ next attempt
def _job_of(attempt: int, *, failed: bool = False) -> dict[str, Any]:
    conditions = [cond("Failed", "BackoffLimitExceeded")] if failed else []
    job = make_job(conditions=conditions)
    job["metadata"]["name"] = f"tj-a{attempt}"
    return job


CKPT_10 = models.CheckpointRef(step=10, path="/ckpt/run/checkpoint-10")
PLANS = [
    # (id, snapshot attempt, recorded, attempts, reported, attempt, resume_from, start_step,
    #  old job attempts)
    ("first", 0, False, [], None, 1, "latest", None, []),
    (
        "after-a-preemption",
        1,
        True,
        [_record(outcome="Preempted", end_time=T0_RFC)],
        CKPT_10,
        2,
        # storage not seen (None): the report is the least step expected, never a path
        "latest",
        10,
        [1],
    ),
    # The Job of an unrecorded attempt is missing: the same attempt again.
    ("recreate-unrecorded", 1, False, [_record()], None, 1, "latest", None, []),
    (
        # The newest failed attempt's Job stays for its logs; older ones go.
        "keeps-the-newest-failed-job",
        2,
        True,
        [
            _record(attempt=1, outcome="Failed", end_time=T0_RFC),
            _record(attempt=2, outcome="Failed", end_time=T0_RFC),
        ],
        None,
        3,
        "latest",
        None,
        [1],
    ),
]


@pytest.mark.parametrize(
    ("snap_attempt", "recorded", "attempts", "reported", "attempt", "resume", "start", "old"),
    [c[1:] for c in PLANS],
    ids=[c[0] for c in PLANS],
)
def test_plan_attempt(
    snap_attempt: int,
    recorded: bool,
    attempts: list[models.AttemptRecord],
    reported: models.CheckpointRef | None,
    attempt: int,
    resume: str,
    start: int | None,
    old: list[int],
) -> None:
    jobs = {n: _job_of(n, failed=True) for n in range(1, snap_attempt + 1)}
    pods = {n: [make_pod(f"p{n}", phase="Failed", exit_code=75)] for n in jobs}
    created = "2026-05-28T20:00:00Z"
    snap = make_snapshot(
        obj={
            "metadata": {"name": "tj", "namespace": "ns", "uid": "u", "creationTimestamp": created}
        },
        attempt=snap_attempt,
        jobs=jobs,
        pods_by_attempt=pods,
    )
    status = models.TrainingJobStatus(attempts=attempts or None)
    plan = plan_attempt(snap, make_spec(), status, recorded, reported, None, None)
    p = plan.params
    assert (p.attempt, p.resume_from, p.start_step) == (attempt, resume, start)
    assert p.fence == attempt_fence(created, attempt) and p.suspended is False
    assert [j["metadata"]["name"] for j in plan.old_jobs] == [f"tj-a{n}" for n in old]
    assert [pod["metadata"]["name"] for pod in plan.old_pods] == [
        f"p{n}" for n in range(1, attempt) if n in pods
    ]
    assert plan.previous == (attempts[-1] if attempts else None)


def test_plan_attempt_grace_doubles_after_a_kill_and_is_capped() -> None:
    killed = _record(outcome="Preempted", end_time=T0_RFC, killed=True, grace_seconds=200)
    status = models.TrainingJobStatus(attempts=[killed])
    snap = make_snapshot(attempt=1)
    plan = plan_attempt(snap, make_spec(), status, True, None, None, None)
    assert plan.params.grace_seconds == plan.grace.seconds == 400
    capped = plan_attempt(snap, make_spec(), status, True, None, None, 250)
    assert capped.params.grace_seconds == 250 and "--max-grace-seconds" in capped.grace.reason


def test_plan_attempt_under_kueue_starts_suspended() -> None:
    plan = plan_attempt(
        make_snapshot(),
        make_spec(queueName="q"),
        models.TrainingJobStatus(),
        False,
        None,
        None,
        None,
    )
    assert plan.params.suspended is True


def test_adopted_params_follow_the_existing_job() -> None:
    planned = render.AttemptParams(
        attempt=2,
        grace_seconds=60,
        resume_from="latest",
        suspended=True,
        start_step=None,
        fence=7,
        save_interval_seconds=300,
    )
    job = _annotated_job(
        **{
            render.ANNOTATION_GRACE: "45",
            render.ANNOTATION_START_STEP: "12",
            render.ANNOTATION_RESUME_FROM: "/c/checkpoint-12",
        }
    )
    assert adopted_params(job, planned) == render.AttemptParams(
        attempt=2,
        grace_seconds=45,
        resume_from="/c/checkpoint-12",
        suspended=True,
        start_step=12,
        fence=7,
    )
    # Not annotated (an older operator's Job): the plan's values.
    bare = adopted_params(make_job(), planned)
    assert (bare.grace_seconds, bare.resume_from, bare.start_step) == (60, "latest", None)


def test_start_attempt_records_it_once() -> None:
    params = render.AttemptParams(
        attempt=2, grace_seconds=45, resume_from="/c/checkpoint-12", suspended=False, start_step=12
    )
    status = models.TrainingJobStatus(
        attempts=[_record(outcome="Preempted", end_time=T0_RFC)],
        next_attempt_after=T0_RFC,
        start_time="2026-01-01T00:00:00Z",
    )
    start_attempt(status, "tj", params, T0_RFC)
    assert status.attempt == 2 and status.next_attempt_after is None
    assert status.start_time == "2026-01-01T00:00:00Z"  # the first attempt's
    assert status.grace_period is not None and status.grace_period.current == 45
    assert status.attempts is not None and len(status.attempts) == 2
    new = status.attempts[-1]
    assert (new.attempt, new.job_name, new.start_time, new.start_step, new.resume_from) == (
        2,
        render.job_name("tj", 2),
        T0_RFC,
        12,
        "/c/checkpoint-12",
    )
    start_attempt(status, "tj", params, "2026-05-28T20:30:00Z")  # a redone pass
    assert len(status.attempts) == 2 and status.attempts[-1].start_time == T0_RFC


def test_attempt_created_message() -> None:
    params = render.AttemptParams(attempt=3, grace_seconds=45, resume_from="", suspended=False)
    assert attempt_created_message("tj", params, "rule") == (
        f"attempt 3: Job {render.job_name('tj', 3)}, grace 45 s (rule), resume from 'scratch'"
    )


# ------------------------------------------------------------------------------ the action's status
ACTIONS = [
    # (id, decision, phase before, invalid, failed condition, completion set, message, event)
    (
        "fail-invalid",
        Decision("Failed", "fail_invalid", Reason.INVALID_SPEC),
        None,
        "spec.numNodes: too many",
        (Reason.INVALID_SPEC, "spec.numNodes: too many"),
        True,
        "spec.numNodes: too many",
        ("Warning", Reason.INVALID_SPEC, "spec.numNodes: too many"),
    ),
    (
        "fail-deadline",
        Decision("Failed", "fail", Reason.DEADLINE_EXCEEDED, "past 600 s"),
        "Running",
        None,
        None,
        True,
        "old",
        None,
    ),
    (
        "finish-restarts-exhausted",
        Decision("Failed", "finish", Reason.RESTARTS_EXHAUSTED, "3 of 3"),
        "Running",
        None,
        (Reason.RESTARTS_EXHAUSTED, "3 of 3"),
        True,
        "old",
        ("Warning", Reason.RESTARTS_EXHAUSTED, "3 of 3"),
    ),
    (
        # Terminal already (a later pass releasing pods): nothing is written again.
        "finish-already-terminal",
        Decision("Failed", "finish", Reason.RESTARTS_EXHAUSTED, "3 of 3"),
        "Failed",
        None,
        None,
        False,
        "old",
        None,
    ),
    (
        "finish-by-policy",
        Decision("Failed", "finish", Reason.FAILED_BY_POLICY, "rule oom"),
        "Running",
        None,
        (Reason.FAILED_BY_POLICY, "rule oom"),
        True,
        "old",
        ("Warning", Reason.FAILED_BY_POLICY, "rule oom"),
    ),
    (
        "finish-succeeded",
        Decision("Succeeded", "finish", Reason.COMPLETED),
        "Running",
        None,
        None,
        True,
        "old",
        None,
    ),
    (
        "none",
        Decision("Running", "none", Reason.STARTED),
        "Running",
        None,
        None,
        False,
        "old",
        None,
    ),
    (
        "create",
        Decision("Pending", "create_attempt", Reason.STARTED),
        None,
        None,
        None,
        False,
        "old",
        None,
    ),
]


@pytest.mark.parametrize(
    ("decision", "phase", "invalid", "failed", "completed", "message", "event"),
    [c[1:] for c in ACTIONS],
    ids=[c[0] for c in ACTIONS],
)
def test_action_status(
    decision: Decision,
    phase: str | None,
    invalid: str | None,
    failed: tuple[str, str] | None,
    completed: bool,
    message: str | None,
    event: tuple[str, str, str] | None,
) -> None:
    status = models.TrainingJobStatus(phase=phase, message="old")  # type: ignore[arg-type]
    got = action_status(decision, status, invalid, T0_RFC, 2)
    found = conds.find_condition(got.conditions, conds.FAILED)
    assert ((found.reason, found.message) if found else None) == failed
    assert got.completion_time == (T0_RFC if completed else None)
    assert (got.message, got.event) == (message, event)
    # A completion time already set is kept.
    earlier = models.TrainingJobStatus(phase=phase, completion_time="2026-01-01T00:00:00Z")  # type: ignore[arg-type]
    kept = action_status(decision, earlier, invalid, T0_RFC, 2).completion_time
    assert kept == "2026-01-01T00:00:00Z"


def test_deactivated_on_record() -> None:
    """Kueue's evictions (and a start that never got all pods ready) end the Workload with the
    attempt; a pod eviction or node loss does not (Kueue did not take the quota back)."""
    assert {
        Reason.KUEUE_PREEMPTED,
        Reason.KUEUE_EVICTED,
        Reason.PODS_NEVER_READY,
        Reason.RESUMED_UNSEEN,  # an eviction seen only afterwards (issue 39)
    } == set(DEACTIVATE_ON_RECORD)
    assert Reason.POD_EVICTED not in DEACTIVATE_ON_RECORD


def test_held_pods() -> None:
    held = make_pod("held")
    held["metadata"]["finalizers"] = ["other", render.ATTEMPT_FINALIZER]
    released = make_pod("released")
    released["metadata"]["finalizers"] = ["other"]
    got = held_pods({1: [released, held], 2: [make_pod("bare")]})
    assert [p["metadata"]["name"] for p in got] == ["held"]


# ------------------------------------------------------------------------------ what is ours
def _owned_job(attempt: int, owner: str, uid: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"tj-a{attempt}",
            "uid": uid,
            "labels": {render.LABEL_ATTEMPT: str(attempt)},
            "ownerReferences": [{"uid": owner, "controller": True}],
        }
    }


def _labelled_pod(
    name: str, attempt: int, *, job_uid: str | None = None, tj_uid: str | None = None
) -> dict[str, Any]:
    pod = make_pod(name)
    pod["metadata"]["labels"][render.LABEL_ATTEMPT] = str(attempt)
    if job_uid is not None:
        pod["metadata"]["ownerReferences"] = [{"uid": job_uid, "controller": True}]
    if tj_uid is not None:
        pod["metadata"]["annotations"][render.ANNOTATION_TJ_UID] = tj_uid
    return pod


def test_owned_children_only_by_owner_uid() -> None:
    """A TrainingJob re-created under the same name never adopts the old incarnation's
    children: Jobs by owner reference, pods by the uid annotation or through their Job."""
    jobs = [
        _owned_job(1, "new", "j-new-1"),
        _owned_job(1, "old", "j-old-1"),
        _owned_job(2, "new", "j-new-2"),
    ]
    pods = [
        _labelled_pod("by-job", 1, job_uid="j-new-1"),
        _labelled_pod("by-annotation", 2, tj_uid="new"),
        _labelled_pod("old-by-job", 1, job_uid="j-old-1"),
        _labelled_pod("old-by-annotation", 1, job_uid="j-new-1", tj_uid="old"),
    ]
    got = owned_children("new", jobs, pods)
    assert {n: j["metadata"]["uid"] for n, j in got.jobs.items()} == {1: "j-new-1", 2: "j-new-2"}
    assert {n: [p["metadata"]["name"] for p in ps] for n, ps in got.pods_by_attempt.items()} == {
        1: ["by-job"],
        2: ["by-annotation"],
    }
    assert [p["metadata"]["name"] for p in got.foreign_pods] == ["old-by-job", "old-by-annotation"]


def test_by_attempt_skips_unlabelled() -> None:
    unlabelled = make_pod("x")
    del unlabelled["metadata"]["labels"][render.LABEL_ATTEMPT]
    assert by_attempt([unlabelled, _labelled_pod("y", 3)]) == {3: [_labelled_pod("y", 3)]}


VALID_RAW: dict[str, Any] = {"image": "img", "command": ["python"], "checkpoint": {"uri": "/c"}}
ATTEMPT_JOB: dict[str, Any] = {
    "metadata": {
        "name": "tj-a1",
        "annotations": {
            render.ANNOTATION_SPEC: json.dumps({**VALID_RAW, "image": "old"}),
        },
    }
}
SPECS = [
    # (id, raw spec, name invalid, attempt, job, spec image, invalid words, rejected words)
    ("valid", VALID_RAW, None, 0, None, "img", None, None),
    ("bad-name", VALID_RAW, "name too long", 0, None, "img", "name too long", None),
    (
        "invalid-before-any-attempt",
        {**VALID_RAW, "numNodes": 0},
        None,
        0,
        None,
        None,
        "numNodes",
        None,
    ),
    # An edit after the job ran: rejected, the attempt's own spec goes on.
    (
        "invalid-edit-after-a-run",
        {**VALID_RAW, "numNodes": 0},
        None,
        1,
        ATTEMPT_JOB,
        "old",
        None,
        "numNodes",
    ),
    (
        "invalid-edit-no-attempt-spec",
        {**VALID_RAW, "numNodes": 0},
        None,
        1,
        None,
        None,
        None,
        "numNodes",
    ),
]


@pytest.mark.parametrize(
    ("raw", "name_invalid", "attempt", "job", "image", "invalid", "rejected"),
    [c[1:] for c in SPECS],
    ids=[c[0] for c in SPECS],
)
def test_pass_spec(
    raw: dict[str, Any],
    name_invalid: str | None,
    attempt: int,
    job: dict[str, Any] | None,
    image: str | None,
    invalid: str | None,
    rejected: str | None,
) -> None:
    got = pass_spec(raw, name_invalid, attempt, job)
    assert (got.spec.image if got.spec else None) == image
    for said, words in ((got.invalid, invalid), (got.rejected, rejected)):
        assert (said is None) is (words is None)
        assert words is None or (said is not None and words in said)


def test_pass_spec_notes_unknown_fields() -> None:
    got = pass_spec({**VALID_RAW, "newFeature": 1}, None, 0, None)
    assert got.spec is not None and got.invalid is None
    assert got.note is not None and "spec.newFeature" in got.note


@pytest.mark.parametrize(
    ("refs", "earlier"),
    [
        ([{"kind": "TrainingJob", "name": "tj", "uid": "old"}], True),
        ([{"kind": "TrainingJob", "name": "other", "uid": "x"}], False),
        ([{"kind": "ConfigMap", "name": "tj", "uid": "x"}], False),
        ([], False),
    ],
    ids=["earlier-incarnation", "another-trainingjob", "another-kind", "unowned"],
)
def test_left_by_earlier_incarnation(refs: list[dict[str, str]], earlier: bool) -> None:
    existing = {"metadata": {"name": "tj-a1", "ownerReferences": refs}}
    assert left_by_earlier_incarnation(existing, "tj") is earlier


# ------------------------------------------------------------------------------ Workloads
MARK = DEACTIVATED_BY_OPERATOR_ANNOTATION


@pytest.mark.parametrize(
    ("workload", "patch"),
    [
        (
            {"metadata": {"name": "w"}, "spec": {"active": True}},
            {"metadata": {"annotations": {MARK: "true"}}, "spec": {"active": False}},
        ),
        (
            {"metadata": {"name": "w", "annotations": {BOOST_ANNOTATION: "40"}}, "spec": {}},
            {
                "metadata": {"annotations": {MARK: "true", BOOST_ANNOTATION: None}},
                "spec": {"active": False},
            },
        ),
        ({"metadata": {"name": "w"}, "spec": {"active": False}}, None),
    ],
    ids=["active", "boosted-victim", "inactive-already"],
)
def test_deactivation_patch(workload: dict[str, Any], patch: dict[str, Any] | None) -> None:
    assert deactivation_patch(workload) == patch
