"""The status a pass builds once, as a value, from the decision and its action's result
(status_build.py): a created attempt, a refused create (the decision stays, the status shows the
refusal), a recorded attempt, the pods the Job controller is refused; the read status and the
status decided on are never changed."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models, render
from preemptible_operator.children import Refusal
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.phases import Decision, PhaseInputs
from preemptible_operator.status_build import (
    ActionResult,
    Started,
    build_status,
    observed_status,
    with_snapshot,
)
from tests.unit.operator.builders import (
    make_job,
    make_pod,
    make_snapshot,
    make_storage_snapshot,
)
from trainer_runtime import protocol

T0 = 1_780_000_000.0
T0_RFC = "2026-05-28T20:26:40Z"

CREATE = Decision("Pending", "create_attempt", Reason.STARTED, "first attempt")
RECORD = Decision("Requeueing", "record_attempt", Reason.KUEUE_PREEMPTED, "Kueue preempted it")
WAIT_PODS = Decision("Pending", "none", Reason.STARTED)
ACTIVE = Interruption("Active", Reason.STARTED)
KUEUE = Interruption("Preempted", Reason.KUEUE_PREEMPTED, "Kueue preempted it")
FORBIDDEN = Refusal(Reason.CHILD_FORBIDDEN, "Job ns/tj-a1 is forbidden: quota", fatal=False)
INVALID = Refusal(Reason.CHILD_INVALID, "Job ns/tj-a1 is invalid: bad field", fatal=True)
PODS_REFUSED = Refusal(Reason.PODS_REFUSED, "no pods: quota", fatal=False)
STARTED = Started(
    render.AttemptParams(attempt=1, grace_seconds=30, resume_from="", suspended=False), nodes=1
)
STORAGE = make_storage_snapshot(8)
PREEMPTED_AT_12 = protocol.TerminationMessage(
    reason="preempted", step=12, checkpoint="/ckpt/run/checkpoint-12", complete=True
).model_dump_json()


def _running_attempt(pods: list[dict[str, Any]]) -> Any:
    """A snapshot of attempt 1, its Job and ``pods``."""
    record = models.AttemptRecord(
        attempt=1, job_name="tj-a1", start_time=T0_RFC, grace_seconds=30, start_step=0
    )
    status = models.TrainingJobStatus(phase="Running", attempt=1, attempts=[record])
    return make_snapshot(
        status=status, attempt=1, job=make_job(), pods=pods, pods_by_attempt={1: pods}
    )


def _refused_before() -> models.TrainingJobStatus:
    refused = conds.set_condition(
        None, conds.CREATE_REFUSED, "True", FORBIDDEN.reason, FORBIDDEN.message, T0_RFC, 1
    )
    return models.TrainingJobStatus(phase="Pending", conditions=refused)


CASES = [
    # (id, snapshot, decision, interruption, action result, shown (phase, action, reason),
    #  phase written, CreateRefused status, requeue, event reasons, status fields)
    (
        "created",
        make_snapshot(),
        CREATE,
        ACTIVE,
        ActionResult(started=STARTED),
        ("Pending", "create_attempt", Reason.STARTED),
        "Pending",
        None,
        None,
        [],  # the create posts its own Event (the Job exists whatever the write does)
        {"attempt": 1, "start_time": T0_RFC, "nodes": "1/1"},
    ),
    (
        # A refused create: the decision stays create_attempt; the status shows the refusal
        # in the decided phase and the pass retries it.
        "refused-create",
        make_snapshot(),
        CREATE,
        ACTIVE,
        ActionResult(refusal=FORBIDDEN),
        ("Pending", "none", Reason.CHILD_FORBIDDEN),
        "Pending",
        "True",
        5.0,  # the first retry (children.refusal_retry_seconds)
        [Reason.CHILD_FORBIDDEN],
        {"attempt": None, "completion_time": None, "message": FORBIDDEN.message},
    ),
    (
        # The apiserver refuses the rendered Job as invalid: the TrainingJob fails.
        "refused-create-fatal",
        make_snapshot(),
        CREATE,
        ACTIVE,
        ActionResult(refusal=INVALID),
        ("Failed", "none", Reason.CHILD_INVALID),
        "Failed",
        "True",
        None,
        [Reason.CHILD_INVALID],
        {"completion_time": T0_RFC, "message": INVALID.message},
    ),
    (
        # Storage's look the refused create took still shows (as before the split).
        "refused-create-keeps-storage-look",
        make_snapshot(),
        CREATE,
        ACTIVE,
        ActionResult(refusal=FORBIDDEN, storage=STORAGE),
        ("Pending", "none", Reason.CHILD_FORBIDDEN),
        "Pending",
        "True",
        5.0,  # the first retry (children.refusal_retry_seconds)
        [Reason.CHILD_FORBIDDEN],
        {"last_complete_checkpoint": models.CheckpointRef(step=8, path="/ckpt/run/checkpoint-8")},
    ),
    (
        # Created after a refusal: CreateRefused turns False.
        "created-after-refusal",
        make_snapshot(status=_refused_before()),
        CREATE,
        ACTIVE,
        ActionResult(started=STARTED),
        ("Pending", "create_attempt", Reason.STARTED),
        "Pending",
        "False",
        None,
        [],
        {"attempt": 1},
    ),
    (
        "recorded-attempt",
        _running_attempt([make_pod(phase="Failed", exit_code=75, message=PREEMPTED_AT_12)]),
        RECORD,
        KUEUE,
        ActionResult(ends_attempt=True, requeue_after=0.0),
        ("Requeueing", "record_attempt", Reason.KUEUE_PREEMPTED),
        "Requeueing",
        None,
        0.0,
        [Reason.KUEUE_PREEMPTED],
        {"preemptions": 1, "lost_steps": 0},
    ),
    (
        # The Job runs but the Job controller is refused its pods: shown, retried.
        "pods-refused",
        _running_attempt([]),
        WAIT_PODS,
        ACTIVE,
        ActionResult(refusal=PODS_REFUSED),
        ("Pending", "none", Reason.PODS_REFUSED),
        "Pending",
        "True",
        5.0,  # the first retry (children.refusal_retry_seconds)
        [Reason.PODS_REFUSED],
        {"message": PODS_REFUSED.message},
    ),
]


@pytest.mark.parametrize(
    ("snap", "decision", "interruption", "done", "shown", "phase", "refused", "requeue",
     "events", "fields"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)  # fmt: skip
def test_build_status(
    snap: Any,
    decision: Decision,
    interruption: Interruption,
    done: ActionResult,
    shown: tuple[str, str, str],
    phase: str,
    refused: str | None,
    requeue: float | None,
    events: list[str],
    fields: dict[str, Any],
) -> None:
    read = snap.status.to_k8s()
    observed = observed_status(snap, True, T0_RFC, T0)
    decided_on = observed.status.to_k8s()
    built = build_status(
        snap, observed, decision, PhaseInputs(), interruption, done, now=T0_RFC, now_s=T0,
        max_grace_seconds=None,
    )  # fmt: skip
    assert (built.shown.phase, built.shown.action, built.shown.reason) == shown
    assert built.phase == phase == built.status.phase
    found = conds.find_condition(built.status.conditions, conds.CREATE_REFUSED)
    assert (found.status if found is not None else None) == refused
    assert built.requeue_after == (pytest.approx(requeue) if requeue is not None else None)
    assert [e[1] for e in built.events] == events
    for key, value in fields.items():
        assert getattr(built.status, key) == value, key
    # Values: neither the read status nor the one decided on changed.
    assert snap.status.to_k8s() == read and observed.status.to_k8s() == decided_on


def test_a_refused_create_keeps_the_decision() -> None:
    decision = Decision("Pending", "create_attempt", Reason.STARTED, "first attempt")
    snap = make_snapshot()
    built = build_status(
        snap, observed_status(snap, True, T0_RFC, T0), decision, PhaseInputs(), ACTIVE,
        ActionResult(refusal=FORBIDDEN), now=T0_RFC, now_s=T0, max_grace_seconds=None,
    )  # fmt: skip
    assert decision == CREATE  # what the pass logged and returns as its action
    assert built.shown == Decision("Pending", "none", FORBIDDEN.reason, FORBIDDEN.message)


def test_recorded_attempt_end_and_outcomes() -> None:
    snap = _running_attempt([make_pod(phase="Failed", exit_code=75, message=PREEMPTED_AT_12)])
    built = build_status(
        snap, observed_status(snap, True, T0_RFC, T0), RECORD, PhaseInputs(), KUEUE,
        ActionResult(ends_attempt=True), now=T0_RFC, now_s=T0, max_grace_seconds=None,
    )  # fmt: skip
    assert built.record is not None and built.record is built.status.attempts[0]  # type: ignore[index]
    assert (built.record.end_time, built.record.outcome, built.record.end_step) == (
        T0_RFC,
        "Preempted",
        12,
    )
    assert built.end is not None and built.end.preempted == Reason.KUEUE_PREEMPTED
    assert built.outcomes == {1: "Preempted"}
    ckpt = built.status.last_complete_checkpoint
    assert ckpt is not None and (ckpt.step, ckpt.path) == (12, "/ckpt/run/checkpoint-12")


@pytest.mark.parametrize(
    ("pods", "running_time", "wait"),
    [
        ([make_pod()], T0_RFC, 5.0),  # its pods run: started now, after 5 s in the queue
        ([make_pod(phase="Pending")], None, None),
        ([], None, None),
    ],
    ids=["runs", "pending", "no-pods"],
)
def test_observed_status(pods: list[dict[str, Any]], running_time: str | None, wait: Any) -> None:
    snap = _running_attempt(pods)
    read = snap.status.to_k8s()
    got = observed_status(snap, False, T0_RFC, T0 + 5)
    assert got.record is not None and got.record is got.status.attempts[0]  # type: ignore[index]
    assert got.record.running_time == running_time and got.queue_wait == wait
    assert got.status.checkpoint_storage_readable is False and not got.recorded
    assert snap.status.to_k8s() == read


def test_with_snapshot_is_a_copy() -> None:
    status = models.TrainingJobStatus()
    assert with_snapshot(status, None) is status
    seen = with_snapshot(status, STORAGE)
    assert seen.last_complete_checkpoint is not None and seen.last_complete_checkpoint.step == 8
    assert status.last_complete_checkpoint is None
