"""What the status shows after a pass's decision (show.py)."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator import conditions as conds
from preemptible_operator import models
from preemptible_operator.conditions import Reason
from preemptible_operator.phases import Decision, PhaseInputs
from preemptible_operator.show import (
    action_status,
    phase_change_event,
    phase_conditions,
    rejected_message,
    shown_phase,
    status_message,
)
from tests.unit.operator.builders import make_spec

T0_RFC = "2026-05-28T20:26:40Z"


def _conditions(ctype: str, status: str, reason: str = "", message: str = "") -> Any:
    return conds.set_condition(None, ctype, status, reason, message, "2026-05-28T20:00:00Z", 1)  # type: ignore[arg-type]


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
