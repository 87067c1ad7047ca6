"""The reconcile pass's decisions (decide.py): snapshot and status in, what changes out."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import models
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.decide import (
    find_record,
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
