"""The reconcile pass's decisions (decide.py): snapshot and status in, what changes out."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models
from preemptible_operator.children import Refusal
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.decide import (
    awaits_pods,
    clear_refused,
    find_record,
    grace_status,
    interruption_of,
    no_pods_wait,
    phase_inputs,
    pods_refusal,
    refusal_outcome,
    starts_now,
    unreachable_condition,
)
from preemptible_operator.phases import Decision
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
    # An invalid edit after the job ran, with the attempt's spec at hand: not held.
    ("rejected-with-attempt-spec", {"rejected": "bad", "attempt": 1}, False, False, False),
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
