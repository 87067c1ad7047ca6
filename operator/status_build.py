"""The status a pass writes, built as a value (pure): the status the decision reads
(``observed_status``) and the new status from the decision and what its action did
(``build_status``). Actions (reconcile.py) make the API calls and report an ``ActionResult``;
they neither change a status nor rewrite the decision (tests/unit/operator/test_status_build.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from preemptible_operator import models, render
from preemptible_operator.checkpoint_store import StorageSnapshot
from preemptible_operator.children import Refusal
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Event, Reason
from preemptible_operator.elastic_attempt import nodes_shown
from preemptible_operator.grace import grace_status
from preemptible_operator.interval import interval_status
from preemptible_operator.observation import Snapshot, starts_now
from preemptible_operator.phases import Decision, PhaseInputs, bound_attempts, estimate_progress
from preemptible_operator.recording import (
    AttemptEnd,
    apply_metrics,
    apply_snapshot,
    record_attempt_end,
)
from preemptible_operator.refusals import awaits_pods, clear_refused, refusal_outcome
from preemptible_operator.show import (
    action_status,
    phase_change_event,
    phase_conditions,
    rejected_message,
    shown_phase,
    status_message,
)
from preemptible_operator.start import current_record, find_record, outcomes, start_attempt
from preemptible_operator.timestamps import parse_rfc3339
from preemptible_operator.unreachable import unreachable_condition

__all__ = [
    "ActionResult",
    "Built",
    "ObservedStatus",
    "Started",
    "build_status",
    "observed_status",
    "with_snapshot",
]


@dataclass(frozen=True)
class ObservedStatus:
    """The status a pass decides on: the read one with what the snapshot adds (the current
    attempt, its record, rank 0's metrics). No step of the pass changes it afterwards."""

    status: models.TrainingJobStatus
    record: models.AttemptRecord | None
    """The current attempt's record (an element of ``status.attempts``)."""
    queue_wait: float | None = None
    """Seconds the attempt waited for its pods, when it is seen running for the first time."""

    @property
    def recorded(self) -> bool:
        """The current attempt's end is recorded already."""
        return self.record is not None and self.record.end_time is not None


def observed_status(
    snap: Snapshot, storage_readable: bool | None, now: str, now_s: float
) -> ObservedStatus:
    """A copy of the read status with the current attempt (its record rebuilt from the Job when
    a crashed pass never wrote it), its nodes, the elastic Workload, whether storage is
    readable from the operator, the attempt's running time once it runs, and rank 0's
    /metrics (recording.apply_metrics)."""
    status = snap.status.model_copy(deep=True)
    spec = snap.spec
    record = current_record(status, snap.attempt, snap.job)
    status.attempt = snap.attempt or status.attempt
    if spec is not None and record is not None and record.nodes is not None:
        # From the attempt's record: a pass that adopted the Job shows it too.
        status.nodes = nodes_shown(record.nodes, spec)
    if spec is not None and spec.elastic is not None and snap.workload is not None:
        status.workload = snap.workload["metadata"]["name"]
    if storage_readable is not None:
        status.checkpoint_storage_readable = storage_readable
    wait = None
    recorded = record is not None and record.end_time is not None
    if spec is not None and snap.attempt and not recorded:
        if record is not None and starts_now(snap, spec, record):
            record.running_time = now
            created_at = parse_rfc3339(record.start_time)
            if created_at is not None:
                wait = max(0.0, now_s - created_at)
        apply_metrics(status, snap.runtime_metrics, spec, snap.attempt)
    return ObservedStatus(status, record, wait)


def with_snapshot(
    status: models.TrainingJobStatus, storage: StorageSnapshot | None
) -> models.TrainingJobStatus:
    """``status`` with storage's look applied (a copy; ``status`` itself when there is none)."""
    if storage is None:
        return status
    out = status.model_copy(deep=True)
    apply_snapshot(out, storage)
    return out


@dataclass(frozen=True)
class Started:
    """The attempt whose Job exists now (created, or adopted from an earlier pass)."""

    params: render.AttemptParams
    nodes: int


@dataclass(frozen=True)
class ActionResult:
    """What the decided action's API calls did, for the status built from it."""

    refusal: Refusal | None = None
    """A child the apiserver refused (or the pods the Job controller is refused)."""
    storage: StorageSnapshot | None = None
    """Storage's look the action took: applied before a create, recorded with an ended attempt."""
    started: Started | None = None
    ends_attempt: bool = False
    """The current attempt's end is to be recorded (record_attempt)."""
    events: tuple[Event, ...] = ()
    requeue_after: float | None = None
    deferred: tuple[Callable[[Built], None], ...] = ()
    """Calls that wait for the status write (releasing pods, deleting ended attempts' Jobs)."""


@dataclass(frozen=True)
class Built:
    """The status a pass writes and what follows from it."""

    status: models.TrainingJobStatus
    record: models.AttemptRecord | None
    """The record of the attempt the pass decided on, in ``status`` (None: none then)."""
    shown: Decision
    """The decision the status shows: the decided one, or a refusal's (no action; Failed when
    the refusal is fatal). The decided one stays the pass's."""
    phase: str
    events: tuple[Event, ...]
    requeue_after: float | None
    """None: no retry of the action's own (the schedule decides)."""
    end: AttemptEnd | None
    """The recorded end of the attempt (record_attempt)."""
    outcomes: Mapping[int, str | None]
    """Each attempt's outcome once the action's end is recorded (before old records are
    dropped): which ended attempts' Jobs go."""
    grace_recommended: int | None


def build_status(
    snap: Snapshot,
    observed: ObservedStatus,
    decision: Decision,
    inputs: PhaseInputs,
    interruption: Interruption,
    action: ActionResult,
    *,
    now: str,
    now_s: float,
    max_grace_seconds: int | None,
) -> Built:
    """The new status, once: the decided action's own writes (show.action_status), the attempt
    ended or started, a refusal (CreateRefused, the phase it shows, the retry), NodeUnreachable,
    the phase shown with its conditions, grace, checkpoint interval and message."""
    spec = snap.spec
    generation = snap.obj["metadata"].get("generation")
    status = observed.status.model_copy(deep=True)
    record = find_record(status, observed.record.attempt) if observed.record else None
    events: list[Event] = []

    done = action_status(decision, status, snap.invalid, now, generation)
    status.conditions, status.completion_time = done.conditions, done.completion_time
    status.message = done.message
    if done.event is not None:
        events.append(done.event)

    end: AttemptEnd | None = None
    if action.ends_attempt:
        assert spec is not None and record is not None  # record_attempt
        end = record_attempt_end(
            status, record, spec, snap.pods, interruption, action.storage, now, now_s, generation
        )
        events.extend(end.events)
    elif action.storage is not None:
        apply_snapshot(status, action.storage)
    ended = outcomes(status)
    if action.started is not None and spec is not None:
        params, nodes = action.started.params, action.started.nodes
        start_attempt(status, snap.obj["metadata"]["name"], params, now)
        started = find_record(status, params.attempt)
        if started is not None and started.nodes is None:
            started.nodes = nodes
        status.nodes = nodes_shown(nodes, spec)
    events.extend(action.events)

    # A refusal shows in the status; the decision stays what was decided.
    shown, requeue, refusal = decision, action.requeue_after, action.refusal
    if refusal is None and (
        decision.action == "create_attempt"
        or (awaits_pods(decision, spec, snap.job, observed.recorded) and snap.pods)
    ):
        status.conditions = clear_refused(status.conditions, now, generation)
    if refusal is not None:
        refused = refusal_outcome(status.conditions, refusal, decision, now, generation, now_s)
        status.conditions = refused.conditions
        if refused.event is not None:
            events.append(refused.event)
        shown = refused.decision
        if refusal.fatal:
            status.completion_time = status.completion_time or now
        else:
            requeue = refused.requeue_after

    if spec is not None:
        status.conditions, event = unreachable_condition(
            snap, spec, status.conditions, observed.recorded, now, generation, now_s
        )
        if event is not None:
            events.append(event)

    # What the status shows after the action.
    follow, new_phase = shown_phase(shown, inputs, spec, status.attempt, status.phase)
    status.conditions = phase_conditions(status.conditions, new_phase, follow, now, generation)
    recommended = None
    if spec is not None:
        grace = grace_status(status, spec, max_grace_seconds, now, generation)
        status.grace_period, status.conditions = grace.grace_period, grace.conditions
        recommended = grace.recommended
        if grace.event is not None:
            events.append(grace.event)
        status.checkpoint_interval, interval_event = interval_status(status, spec, now_s)
        if interval_event:
            events.append(("Normal", Reason.CHECKPOINT_INTERVAL, interval_event))
    changed = phase_change_event(status.phase, new_phase, shown, events)
    if changed is not None:
        events.append(changed)
    status.phase = new_phase
    if new_phase in ("Succeeded", "Failed") and status.completion_time is None:
        # Every way to the end (a success is recorded straight into Succeeded): the TTL after
        # finishing counts from here.
        status.completion_time = now
    status.progress = estimate_progress(status.progress, status.timings, new_phase)
    status.message = status_message(status.message, follow, shown, new_phase, snap.invalid)
    status.observed_generation = generation
    if snap.rejected is not None:
        status.message = rejected_message(snap.rejected, spec is not None)
        if snap.status.observed_generation != generation:
            events.append(("Warning", Reason.SPEC_CHANGE_REJECTED, status.message))
    if status.attempts:
        status.attempts, dropped = bound_attempts(status.attempts)
        if dropped:
            status.attempts_omitted = (status.attempts_omitted or 0) + dropped
    return Built(status, record, shown, new_phase, tuple(events), requeue, end, ended, recommended)
