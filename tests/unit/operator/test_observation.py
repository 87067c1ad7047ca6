"""What a pass observed and the state machine's inputs read from it (observation.py)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import models
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.observation import (
    earlier_attempts_active,
    interruption_of,
    phase_inputs,
    starts_now,
)
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
