"""Recording an ended attempt (recording.record_attempt_end): record, timings, checkpoint, lost
steps, preemptions, failures and the restart backoff, from the pods' terminated states."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models
from preemptible_operator.checkpoint_store import StorageSnapshot
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.recording import record_attempt_end
from tests.unit.operator.builders import make_pod, make_spec
from trainer_runtime import protocol
from trainer_runtime.checkpoint.layout import CheckpointInfo

T0 = 1_780_000_000.0
T0_RFC = "2026-05-28T20:26:40Z"


def _msg(reason: str, step: int, **extra: Any) -> str:
    return protocol.TerminationMessage(reason=reason, step=step, **extra).model_dump_json()  # type: ignore[arg-type]


PREEMPTED_AT_12 = _msg(
    "preempted",
    12,
    checkpoint="/ckpt/run/checkpoint-12",
    complete=True,
    sigterm_to_exit_seconds=4.5,
)
KUEUE = Interruption("Preempted", Reason.KUEUE_PREEMPTED, "Kueue preempted it")
FAILED = Interruption("Failed", Reason.TRAINING_FAILED, "exit 1")
DONE = Interruption("Succeeded", Reason.COMPLETED, "")
RESTART_ON_1 = {"rules": [{"name": "flaky", "action": "Restart", "onExitCodes": [1]}]}
IGNORE_ON_1 = {"rules": [{"name": "data", "action": "Ignore", "onExitCodes": [1]}]}

CASES = [
    # (id, pods, interruption, spec fields, checkpoint known, expected record fields,
    #  expected status fields, event reasons in order, lost, preempted)
    (
        "preempted-checkpoint-at-the-end",
        [make_pod(phase="Failed", exit_code=75, message=PREEMPTED_AT_12)],
        KUEUE,
        {},
        None,
        {"outcome": "Preempted", "end_step": 12, "checkpoint": "/ckpt/run/checkpoint-12"},
        {"preemptions": 1, "lost_steps": 0, "failures": None, "next_attempt_after": None},
        [Reason.KUEUE_PREEMPTED],
        0,
        Reason.KUEUE_PREEMPTED,
    ),
    (
        "preempted-without-a-save-loses-steps",
        [make_pod(phase="Failed", exit_code=75, message=_msg("preempted", 15))],
        KUEUE,
        {},
        10,
        {"outcome": "Preempted", "end_step": 15, "checkpoint": "/ckpt/run/checkpoint-10"},
        {"preemptions": 1, "lost_steps": 5},
        [Reason.LOST_STEPS, Reason.KUEUE_PREEMPTED],
        5,
        Reason.KUEUE_PREEMPTED,
    ),
    (
        # No failure policy: the default verdict, counted, the first backoff (10 s).
        "failed-counted",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 3},
        None,
        {"outcome": "Failed", "failure_action": "Restart", "failure_rule": None},
        {"failures": 1, "next_attempt_after": "2026-05-28T20:26:50Z", "preemptions": None},
        [Reason.LOST_STEPS, Reason.BACKOFF, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        "failed-restarted-by-a-rule",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 3, "failurePolicy": RESTART_ON_1},
        None,
        {"outcome": "Failed", "failure_action": "Restart", "failure_rule": "flaky"},
        {"failures": 1, "failure_times": [T0_RFC]},
        [Reason.LOST_STEPS, Reason.BACKOFF, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        "failed-ignored-by-a-rule",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 3, "failurePolicy": IGNORE_ON_1},
        None,
        {"outcome": "Failed", "failure_action": "Ignore", "failure_rule": "data"},
        {"failures": None, "failure_times": None, "next_attempt_after": "2026-05-28T20:26:50Z"},
        [Reason.LOST_STEPS, Reason.FAILURE_IGNORED, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        # The restarts are used up: no BACKOFF Event (the state machine fails the job).
        "failed-past-max-restarts",
        [make_pod(phase="Failed", exit_code=1, message=_msg("failed", 7))],
        FAILED,
        {"maxRestarts": 0},
        None,
        {"outcome": "Failed"},
        {"failures": 1},
        [Reason.LOST_STEPS, Reason.TRAINING_FAILED],
        7,
        None,
    ),
    (
        "succeeded",
        [make_pod(phase="Succeeded", exit_code=0, message=_msg("completed", 100))],
        DONE,
        {},
        None,
        {"outcome": "Succeeded", "end_step": 100, "lost_steps": 0},
        {"lost_steps": 0, "preemptions": None, "failures": None},
        [Reason.COMPLETED],
        0,
        None,
    ),
]


@pytest.mark.parametrize(
    ("pods", "interruption", "spec_fields", "known", "record_fields", "status_fields", "events",
     "lost", "preempted"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)  # fmt: skip
def test_record_attempt_end(
    pods: list[dict[str, Any]],
    interruption: Interruption,
    spec_fields: dict[str, Any],
    known: int | None,
    record_fields: dict[str, Any],
    status_fields: dict[str, Any],
    events: list[str],
    lost: int,
    preempted: str | None,
) -> None:
    record = models.AttemptRecord(attempt=1, job_name="tj-a1", grace_seconds=30, start_step=0)
    status = models.TrainingJobStatus(attempt=1, attempts=[record])
    if known is not None:
        status.last_complete_checkpoint = models.CheckpointRef(
            step=known, path=f"/ckpt/run/checkpoint-{known}"
        )
    spec = make_spec(**spec_fields)
    end = record_attempt_end(status, record, spec, pods, interruption, None, T0_RFC, T0, 4)
    assert record.end_time == T0_RFC and record.reason == interruption.reason
    for key, value in record_fields.items():
        assert getattr(record, key) == value, key
    for key, value in status_fields.items():
        assert getattr(status, key) == value, key
    assert [e[1] for e in end.events] == events
    assert end.lost_steps == lost and record.lost_steps == lost
    assert end.preempted == preempted
    preempted_cond = conds.find_condition(status.conditions, conds.PREEMPTED)
    if preempted is None:
        assert preempted_cond is None
    else:
        assert preempted_cond is not None and preempted_cond.status == "True"
        assert preempted_cond.observed_generation == 4


def test_rank0_sigterm_and_timings() -> None:
    """Rank 0's SIGTERM-to-exit is the attempt's; every pod's counts for the maxima."""
    pods = [
        make_pod("a", index=0, phase="Failed", exit_code=75, message=PREEMPTED_AT_12),
        make_pod(
            "b",
            index=1,
            phase="Failed",
            exit_code=75,
            message=_msg("preempted", 12, sigterm_to_exit_seconds=9.0),
        ),
    ]
    record = models.AttemptRecord(attempt=1, job_name="tj-a1", grace_seconds=30)
    status = models.TrainingJobStatus(attempts=[record])
    end = record_attempt_end(status, record, make_spec(), pods, KUEUE, None, T0_RFC, T0, 1)
    assert end.sigterm_to_exit == 4.5 and record.sigterm_to_exit_seconds == 4.5
    assert status.timings is not None and status.timings.sigterm_to_exit_seconds_max == 9.0
    assert record.exit_codes == [75, 75]


def test_storage_snapshot_newer_than_the_report_wins() -> None:
    """Storage shows a newer complete checkpoint than the runtime's report: it is recorded."""
    pods = [make_pod(phase="Failed", exit_code=75, message=PREEMPTED_AT_12)]
    snapshot = StorageSnapshot(
        latest_complete=CheckpointInfo(
            path="/ops/run/checkpoint-14",
            name="checkpoint-14",
            step=14,
            complete=True,
            reason=None,
            size_bytes=1,
            manifest=None,
            attempt=1,
        ),
        latest_complete_path="/ckpt/run/checkpoint-14",
        incomplete=(),
    )
    record = models.AttemptRecord(attempt=1, job_name="tj-a1", grace_seconds=30)
    status = models.TrainingJobStatus(attempts=[record])
    record_attempt_end(status, record, make_spec(), pods, KUEUE, snapshot, T0_RFC, T0, 1)
    assert record.checkpoint == "/ckpt/run/checkpoint-14"
    assert status.last_complete_checkpoint is not None
    assert status.last_complete_checkpoint.step == 14
