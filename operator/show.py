"""What the status shows after a pass's decision (pure): the decided action's own writes, the
phase shown, the conditions that follow the phase, the phase-change Event and status.message
(tests/unit/operator/test_show.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from preemptible_operator import conditions as cond
from preemptible_operator import models
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Event, Reason
from preemptible_operator.phases import TERMINAL_PHASES, Decision, PhaseInputs, next_phase

__all__ = [
    "ActionStatus",
    "action_status",
    "phase_change_event",
    "phase_conditions",
    "rejected_message",
    "shown_phase",
    "status_message",
]


@dataclass(frozen=True)
class ActionStatus:
    """What the decided action itself writes into the status (before the phase is shown)."""

    conditions: list[models.Condition] | None
    completion_time: str | None
    message: str | None
    event: Event | None


def action_status(
    decision: Decision,
    status: models.TrainingJobStatus,
    invalid: str | None,
    now: str,
    generation: int | None,
) -> ActionStatus:
    """fail_invalid: Failed/InvalidSpec with why; fail (the deadline): the completion time;
    finish of a job not yet terminal: the completion time, and condition Failed with an Event
    when the restarts are used up or the failure policy failed it."""
    conditions, completion, message = status.conditions, status.completion_time, status.message
    event: Event | None = None
    if decision.action == "fail_invalid":
        message = invalid
        conditions = cond.set_condition(
            conditions, cond.FAILED, "True", Reason.INVALID_SPEC, invalid or "", now, generation
        )
        completion = completion or now
        event = ("Warning", Reason.INVALID_SPEC, invalid or "")
    elif decision.action == "fail":
        completion = completion or now
    elif decision.action == "finish" and status.phase not in TERMINAL_PHASES:
        completion = completion or now
        if decision.reason in (Reason.RESTARTS_EXHAUSTED, Reason.FAILED_BY_POLICY):
            conditions = cond.set_condition(
                conditions,
                cond.FAILED,
                "True",
                decision.reason,
                decision.message,
                now,
                generation,
            )
            event = ("Warning", decision.reason, decision.message)
    return ActionStatus(conditions, completion, message, event)


def after_create(inputs: PhaseInputs, attempt: int, spec: models.TrainingJobSpec) -> Decision:
    """What the next pass decides once the attempt just created is seen (its Job, no pods
    yet): the status is written with that at once, so the pass the new Job's watch event
    wakes finds nothing to write."""
    return next_phase(
        dataclasses.replace(
            inputs,
            current_phase=None,
            attempt=attempt,
            recorded_outcome=None,
            job_exists=True,
            job_suspended=bool(spec.queue_name),
            interruption=Interruption("Active", Reason.STARTED),
            pods_finished=True,
            pods=0,
            running_pods=0,
            pending_detail=None,
            previous_pods_active=0,
            backoff_remaining=0.0,
        )
    )


def shown_phase(
    decision: Decision,
    inputs: PhaseInputs,
    spec: models.TrainingJobSpec | None,
    attempt: int | None,
    current_phase: str | None,
) -> tuple[Decision, str]:
    """The decision the status shows and its phase. Once an attempt is created (``attempt``,
    status.attempt after the create) it shows what the next pass will see (after_create);
    a create that changes the phase shows Queued under Kueue, else Pending."""
    shown = decision
    if decision.action == "create_attempt" and spec is not None:
        follow = after_create(inputs, attempt or 1, spec)
        if follow.action == "none":
            shown = follow
    phase = shown.phase
    if shown.action == "create_attempt" and current_phase != phase:
        phase = "Queued" if spec and spec.queue_name else "Pending"
    return shown, phase


def phase_conditions(
    conditions: list[models.Condition] | None,
    phase: str,
    decision: Decision,
    now: str,
    generation: int | None,
) -> list[models.Condition] | None:
    """The conditions that follow the phase (Admitted, Running, Checkpointing, Preempted back
    to False on resume, Succeeded, Failed) and the lifecycle ones."""
    c = conditions
    msg = decision.message or ""
    admitted = phase in ("Running", "Checkpointing", "Succeeded")
    if phase == "Queued":
        c = cond.set_condition(c, cond.ADMITTED, "False", Reason.QUEUED, msg, now, generation)
    elif admitted:
        c = cond.set_condition(c, cond.ADMITTED, "True", Reason.ADMITTED, "", now, generation)
    c = cond.set_condition(
        c,
        cond.RUNNING,
        "True" if phase == "Running" else "False",
        Reason.STARTED if phase == "Running" else decision.reason,
        msg,
        now,
        generation,
    )
    c = cond.set_condition(
        c,
        cond.CHECKPOINTING,
        "True" if phase == "Checkpointing" else "False",
        decision.reason,
        msg,
        now,
        generation,
    )
    if phase == "Running":
        pre = cond.find_condition(c, cond.PREEMPTED)
        if pre is not None and pre.status == "True":
            c = cond.set_condition(
                c,
                cond.PREEMPTED,
                "False",
                Reason.RESUMED,
                "resumed after the preemption",
                now,
                generation,
            )
    if phase == "Succeeded":
        c = cond.set_condition(
            c, cond.SUCCEEDED, "True", Reason.COMPLETED, "training finished", now, generation
        )
    if phase == "Failed":
        existing = cond.find_condition(c, cond.FAILED)
        if existing is None or existing.status != "True":
            c = cond.set_condition(c, cond.FAILED, "True", decision.reason, msg, now, generation)
    return cond.lifecycle_conditions(c, phase, now, generation)


def phase_change_event(
    old_phase: str | None, new_phase: str, decision: Decision, events: Sequence[Event]
) -> Event | None:
    """An Event when the phase changes (a create posts its own), unless the pass posts one with
    the decision's reason already."""
    if old_phase == new_phase or decision.action == "create_attempt":
        return None
    if any(e[1] == decision.reason for e in events):
        return None
    etype = "Warning" if new_phase == "Failed" else "Normal"
    return (etype, decision.reason, decision.message or f"phase {old_phase or '-'} -> {new_phase}")


def status_message(
    current: str | None,
    shown: Decision,
    decision: Decision,
    new_phase: str,
    invalid: str | None,
) -> str | None:
    """status.message: the shown decision's message (why the spec is invalid when failing for
    it); "training finished" once Succeeded; cleared while Running; else kept."""
    if shown.message and new_phase != "Succeeded":
        return shown.message if decision.action != "fail_invalid" else invalid
    if new_phase == "Succeeded":
        return "training finished"
    if new_phase == "Running":
        return None
    return current


def rejected_message(rejected: str, spec_at_hand: bool) -> str:
    """status.message while an invalid spec edit is rejected."""
    keep = (
        "the running attempt goes on with its spec, no new attempt until it is fixed"
        if spec_at_hand
        else "no new attempt"
    )
    return f"spec change rejected ({keep}): {rejected}"
