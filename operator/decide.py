"""The decisions of one reconcile pass, as pure functions of what the pass observed.

``reconcile.Reconciler`` observes (reads the TrainingJob and its children into a ``Snapshot``),
calls these functions and acts on what they return (API calls, one status write). Nothing here
reads the clock, the API or storage: the time and every observation are arguments, so each
decision has a table test (tests/unit/operator/test_decide.py).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from preemptible_operator import conditions as cond
from preemptible_operator import models, render
from preemptible_operator.accounting import limited_preemptions
from preemptible_operator.checkpoint_store import StorageSnapshot
from preemptible_operator.children import (
    Refusal,
    attempt_pods_finished,
    job_terminal,
    jobs_to_delete,
    no_pod_can_follow,
    pods_refused,
    refusal_retry_seconds,
    restarted_pods,
)
from preemptible_operator.classify import (
    DEACTIVATED_BY_OPERATOR_ANNOTATION,
    Interruption,
    attempt_started,
    classify_interruption,
    pending_detail,
    pod_finished,
)
from preemptible_operator.conditions import Reason
from preemptible_operator.failure_policy import counted_failures
from preemptible_operator.grace import GraceDecision, grace_sufficiency, next_grace
from preemptible_operator.interval import auto_save_interval
from preemptible_operator.ownership import owned_by, pod_owned
from preemptible_operator.phases import (
    TERMINAL_PHASES,
    Decision,
    PhaseInputs,
    deadline_remaining,
    next_attempt_number,
    next_phase,
    ttl_remaining,
)
from preemptible_operator.recording import snapshot_ref
from preemptible_operator.resume import attempt_fence, resume_checkpoint
from preemptible_operator.scrape import RuntimeMetrics
from preemptible_operator.timestamps import parse_rfc3339
from preemptible_operator.unreachable import stuck_on_unreachable_nodes
from preemptible_operator.victims import BOOST_ANNOTATION

__all__ = [
    "DEACTIVATE_ON_RECORD",
    "ActionStatus",
    "AttemptPlan",
    "Children",
    "Event",
    "GraceOutcome",
    "InterruptionView",
    "PassSpec",
    "RefusalOutcome",
    "Snapshot",
    "Wake",
    "action_status",
    "adopted_params",
    "attempt_created_message",
    "awaits_pods",
    "by_attempt",
    "cap_grace",
    "clear_refused",
    "current_record",
    "deactivation_patch",
    "deadline_wake",
    "earlier_attempts_active",
    "find_record",
    "grace_status",
    "held_pods",
    "interruption_of",
    "left_by_earlier_incarnation",
    "no_pods_wait",
    "outcomes",
    "owned_children",
    "parse_spec_tolerant",
    "pass_spec",
    "phase_change_event",
    "phase_conditions",
    "phase_inputs",
    "plan_attempt",
    "pods_refusal",
    "refusal_outcome",
    "rejected_message",
    "running_pods",
    "shown_phase",
    "spec_of_job",
    "start_attempt",
    "starts_now",
    "status_message",
    "unreachable_condition",
    "wake_after",
]

Event = tuple[str, str, str]
"""(type, reason, message) of an Event on the TrainingJob."""


@dataclass(frozen=True)
class Snapshot:
    """Everything one pass read, before it decides anything (immutable: the decisions return
    what changes, the pass applies it to its own copy of the status)."""

    obj: dict[str, Any]
    status: models.TrainingJobStatus
    """The status as read (the pass works on a deep copy)."""
    spec: models.TrainingJobSpec | None
    invalid: str | None
    jobs: dict[int, dict[str, Any]]
    pods_by_attempt: dict[int, list[dict[str, Any]]]
    attempt: int
    job: dict[str, Any] | None
    pods: list[dict[str, Any]]
    workload: dict[str, Any] | None
    workload_version: str | None
    node_ready: dict[str, bool]
    node_not_ready_since: dict[str, float] = field(default_factory=dict)
    """When each NotReady node of the current attempt's pods went NotReady (its Ready
    condition's lastTransitionTime), where the Node says."""
    rejected: str | None = None
    """Why the current spec was rejected (an invalid edit after the job ran); ``spec`` is then
    the spec of the running attempt, or None."""
    previous_pods: list[dict[str, Any]] = field(default_factory=list)
    """Pods labelled with this name that belong to an earlier incarnation and still run."""
    runtime_metrics: RuntimeMetrics | None = None
    """Rank 0's /metrics, read by periodic passes while the current attempt has running pods."""


def find_record(status: models.TrainingJobStatus, attempt: int) -> models.AttemptRecord | None:
    """The record of ``attempt`` in status.attempts, if any."""
    for rec in status.attempts or []:
        if rec.attempt == attempt:
            return rec
    return None


def current_record(
    status: models.TrainingJobStatus, attempt: int, job: dict[str, Any] | None
) -> models.AttemptRecord | None:
    """The current attempt's record in the pass's working status. A Job without a record: the
    pass that created it crashed before writing the status; the record is rebuilt from the
    Job's annotations (and the backoff that preceded it is over)."""
    record = find_record(status, attempt)
    if not attempt or record is not None or job is None:
        return record
    ann = job["metadata"].get("annotations") or {}
    record = models.AttemptRecord(
        attempt=attempt,
        job_name=job["metadata"]["name"],
        start_time=job["metadata"].get("creationTimestamp"),
        resume_from=ann.get(render.ANNOTATION_RESUME_FROM),
        start_step=_int_or_none(ann.get(render.ANNOTATION_START_STEP)),
        grace_seconds=_int_or_none(ann.get(render.ANNOTATION_GRACE)),
    )
    status.attempts = [*(status.attempts or []), record]
    # The pass that created attempt 1 never wrote status.startTime either: the Job's creation
    # is when activeDeadlineSeconds starts to count (never left unset: no deadline then).
    status.start_time = status.start_time or record.start_time
    status.next_attempt_after = None
    gp = status.grace_period or models.GraceStatus()
    gp.current = record.grace_seconds
    status.grace_period = gp
    return record


def running_pods(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods in phase Running."""
    return [p for p in pods if (p.get("status") or {}).get("phase") == "Running"]


def starts_now(
    snap: Snapshot, spec: models.TrainingJobSpec, record: models.AttemptRecord | None
) -> bool:
    """Whether the current attempt is seen started for the first time (its record gets its
    runningTime now). Started only once all its pods ran together: 15 of 16 running and one
    unschedulable is an attempt that could not start (classify_interruption)."""
    if record is None or record.running_time is not None:
        return False
    expected = int(((snap.job or {}).get("spec") or {}).get("completions") or 0)
    return attempt_started(snap.pods, expected or spec.num_nodes)


@dataclass(frozen=True)
class InterruptionView:
    """How the current attempt stands, and whether someone else deactivated its Workload."""

    interruption: Interruption
    deactivated_by_other: bool = False
    """The Workload was deactivated by someone else while spec.suspend is false: the pass
    suspends the TrainingJob (as Kueue suspends a Job) rather than create a fresh, active
    Workload, and does nothing else (``interruption`` is then the classification as is)."""


ACTIVE = Interruption("Active", Reason.STARTED)


def interruption_of(
    snap: Snapshot,
    spec: models.TrainingJobSpec | None,
    record: models.AttemptRecord | None,
    recorded: bool,
    deadline_passed: bool = False,
) -> InterruptionView:
    """Classify the current attempt (Active while there is none or it is recorded already).
    ``record`` carries the runningTime this pass may just have set (starts_now).
    ``deadline_passed``: activeDeadlineSeconds passed; the operator stops the attempt, and
    whatever its pods show then (unless they finished training) it ends for the deadline."""
    if spec is None or not snap.attempt or recorded:
        return InterruptionView(ACTIVE)
    started = record is not None and record.running_time is not None
    interruption = classify_interruption(
        snap.job,
        snap.pods,
        snap.workload,
        node_ready=snap.node_ready,
        # Its pods exist only once Kueue admitted (unsuspended) its Job.
        was_admitted=bool(snap.pods) or started,
        was_started=started,
        user_suspended=spec.suspend,
    )
    if deadline_passed and interruption.outcome != "Succeeded":
        # Recorded like a suspension: no preemption, no failure counted (the job is over).
        return InterruptionView(
            Interruption(
                "Suspended",
                Reason.DEADLINE_EXCEEDED,
                f"activeDeadlineSeconds ({spec.active_deadline_seconds}) passed: stopped by "
                "the operator",
            )
        )
    restarted = restarted_pods(snap.pods, snap.node_ready)
    if restarted and interruption.outcome != "Succeeded":
        # Checked before anything the new pods show: the attempt ended when its Job was
        # suspended, whatever its Workload says now.
        return InterruptionView(
            Interruption(
                "Preempted",
                Reason.RESUMED_UNSEEN,
                f"{len(restarted)} pod(s) of attempt {snap.attempt} restarted from its old "
                "checkpoint after its Job was suspended and resumed unseen (a Kueue eviction "
                "and re-admission): stopping them, the next attempt resumes from the newest",
            )
        )
    if interruption.reason == Reason.WORKLOAD_DEACTIVATED and not spec.suspend:
        return InterruptionView(interruption, deactivated_by_other=True)
    if snap.job is None and snap.pods and not interruption.over:
        interruption = Interruption(
            "Preempted",
            Reason.KUEUE_EVICTED if spec.queue_name else Reason.JOB_FAILED,
            "the attempt's Job was deleted",
        )
    return InterruptionView(interruption)


def phase_inputs(
    snap: Snapshot,
    status: models.TrainingJobStatus,
    record: models.AttemptRecord | None,
    recorded: bool,
    interruption: Interruption,
    now: float,
) -> PhaseInputs:
    """What next_phase needs, from the snapshot and the pass's status so far."""
    spec = snap.spec
    backoff_left = 0.0
    next_after = parse_rfc3339(status.next_attempt_after)
    if next_after is not None:
        backoff_left = max(0.0, next_after - now)
    window = (
        spec.failure_policy.restart_window_seconds
        if spec is not None and spec.failure_policy is not None
        else None
    )
    done = record if recorded else None
    return PhaseInputs(
        invalid=snap.invalid is not None,
        current_phase=status.phase,
        suspend=bool(spec and spec.suspend),
        attempt=snap.attempt,
        recorded_outcome=done.outcome if done else None,
        recorded_reason=done.reason if done else None,
        job_exists=snap.job is not None,
        job_suspended=bool(snap.job and (snap.job.get("spec") or {}).get("suspend")),
        interruption=interruption,
        pods_finished=attempt_pods_finished(snap.job, snap.pods, snap.node_ready),
        pods=len(snap.pods),
        running_pods=len(running_pods(snap.pods)),
        failures=counted_failures(status.failures or 0, status.failure_times, now, window),
        max_restarts=spec.max_restarts if spec else 0,
        recorded_failure_action=done.failure_action if done else None,
        recorded_failure_rule=done.failure_rule if done else None,
        restart_window_seconds=window,
        backoff_remaining=backoff_left,
        kueue=bool(spec and spec.queue_name),
        previous_pods_active=len(snap.previous_pods),
        earlier_attempts_active=sum(
            map(len, earlier_attempts_active(snap, next_attempt_number(snap.attempt, recorded)))
        ),
        pending_detail=pending_detail(snap.pods) if snap.pods else None,
        # Held whether or not the attempt's spec is at hand: the running attempt goes on with
        # it, but no new attempt starts from a spec the user has since replaced.
        spec_rejected=snap.rejected is not None,
        active_deadline_seconds=spec.active_deadline_seconds if spec else None,
        deadline_remaining=deadline_remaining(
            status.start_time, spec.active_deadline_seconds if spec else None, now
        ),
        preemptions=limited_preemptions(status.preemptions, status.preemptions_before_running),
        max_preemptions=spec.max_preemptions if spec else None,
    )


def earlier_attempts_active(
    snap: Snapshot, next_attempt: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Pods of attempts before ``next_attempt`` that are not finished, and their Jobs that can
    still start pods (not terminal, not being deleted, not all indexes held by ended pods).
    Normally none: an attempt is recorded only once its pods ended, and its Job is deleted
    after. But a cache behind the Job controller, or a Job that Kueue admitted again during
    the restart backoff, can hide a pod that still writes checkpoints: the next attempt waits
    for them (and stops them), so two attempts never run at once. Pods on a node that cannot
    be read count as not finished (never guessed gone)."""
    pods = [
        p
        for n, ps in snap.pods_by_attempt.items()
        if n < next_attempt
        for p in ps
        if not pod_finished(p)
    ]
    jobs = [
        j
        for n, j in snap.jobs.items()
        if n < next_attempt
        and not (j.get("metadata") or {}).get("deletionTimestamp")
        and not job_terminal(j)
        and not no_pod_can_follow(j, snap.pods_by_attempt.get(n) or [])
    ]
    return pods, jobs


# ------------------------------------------------------------------------------ refusals
def clear_refused(
    conditions: list[models.Condition] | None, now: str, generation: int | None
) -> list[models.Condition] | None:
    """CreateRefused set False (the children exist now), where it was True."""
    before = cond.find_condition(conditions, cond.CREATE_REFUSED)
    if before is None or before.status != "True":
        return conditions
    return cond.set_condition(
        conditions, cond.CREATE_REFUSED, "False", Reason.CREATED, "", now, generation
    )


def awaits_pods(
    decision: Decision,
    spec: models.TrainingJobSpec | None,
    job: dict[str, Any] | None,
    recorded: bool,
) -> bool:
    """The attempt's Job exists, is not suspended and the pass waits for its pods (Pending): the
    pass then clears a refusal once pods exist, or looks why there are none."""
    return (
        decision.action == "none"
        and decision.phase == "Pending"
        and spec is not None
        and job is not None
        and not recorded
        and not (job.get("spec") or {}).get("suspend")
    )


def pods_refusal(job: dict[str, Any], events: list[dict[str, Any]]) -> Refusal | None:
    """The Job controller is refused the attempt's pods (a ResourceQuota, Pod Security
    Admission): it retries by itself; the refusal only shows why (never fatal)."""
    why = pods_refused(job, events)
    if why is None:
        return None
    return Refusal(
        Reason.PODS_REFUSED,
        f"the Job controller cannot create the pods of Job {job['metadata']['name']}: {why}",
        fatal=False,
    )


def no_pods_wait(job: dict[str, Any], now: float) -> float:
    """When to look again at a Job that has no pods and no refusal yet (no watch event comes
    for a refusal): backing off with the Job's age."""
    created = parse_rfc3339(job["metadata"].get("creationTimestamp"))
    return refusal_retry_seconds(now - created if created is not None else 0.0)


@dataclass(frozen=True)
class RefusalOutcome:
    """What a refused child does to the pass: CreateRefused True, the decision it replaces."""

    conditions: list[models.Condition]
    decision: Decision
    """Failed for a fatal refusal (the spec cannot succeed), else the decided phase; no action."""
    event: Event | None
    """A Warning when the refusal is new or says something new."""
    requeue_after: float | None
    """When to retry (None when fatal: nothing to retry)."""


def refusal_outcome(
    conditions: list[models.Condition] | None,
    refusal: Refusal,
    decision: Decision,
    now: str,
    generation: int | None,
    now_s: float,
) -> RefusalOutcome:
    """Condition CreateRefused True with the refusal; a retry backing off with how long it has
    been refused (since the condition turned True)."""
    before = cond.find_condition(conditions, cond.CREATE_REFUSED)
    after = cond.set_condition(
        conditions,
        cond.CREATE_REFUSED,
        "True",
        refusal.reason,
        refusal.message,
        now,
        generation,
    )
    event: Event | None = None
    if (
        before is None
        or before.status != "True"
        or (before.reason, before.message) != (refusal.reason, refusal.message)
    ):
        event = ("Warning", refusal.reason, refusal.message)
    shown = Decision(
        "Failed" if refusal.fatal else decision.phase, "none", refusal.reason, refusal.message
    )
    requeue: float | None = None
    if not refusal.fatal:
        now_refused = cond.find_condition(after, cond.CREATE_REFUSED)
        since = parse_rfc3339(now_refused.last_transition_time if now_refused else None)
        requeue = refusal_retry_seconds(now_s - since if since is not None else 0.0)
    return RefusalOutcome(after, shown, event, requeue)


# ------------------------------------------------------------------------------ unreachable nodes
def unreachable_condition(
    snap: Snapshot,
    spec: models.TrainingJobSpec,
    conditions: list[models.Condition] | None,
    recorded: bool,
    now: str,
    generation: int | None,
    now_s: float,
) -> tuple[list[models.Condition] | None, Event | None]:
    """Condition NodeUnreachable (and one Warning Event when it turns True) while a pod of the
    current attempt is stuck on a NotReady node past spec.unreachableNode's bound; False once
    none is (no condition at all for a job that never had one stuck)."""
    stuck = None
    if snap.pods and not recorded:
        stuck = stuck_on_unreachable_nodes(
            snap.pods,
            snap.node_ready,
            snap.node_not_ready_since,
            now_s,
            spec.unreachable_node.escalate_after_seconds,
        )
    before = cond.find_condition(conditions, cond.NODE_UNREACHABLE)
    if stuck is not None:
        message = stuck.message(now_s)
        after = cond.set_condition(
            conditions,
            cond.NODE_UNREACHABLE,
            "True",
            Reason.OUT_OF_SERVICE_NEEDED,
            message,
            now,
            generation,
        )
        if before is None or before.status != "True":
            return after, ("Warning", Reason.OUT_OF_SERVICE_NEEDED, message)
        return after, None
    if before is not None and before.status == "True":
        return cond.set_condition(
            conditions,
            cond.NODE_UNREACHABLE,
            "False",
            Reason.NODES_REACHABLE,
            "no pod of the attempt is stuck on a NotReady node",
            now,
            generation,
        ), None
    return conditions, None


# ------------------------------------------------------------------------------ grace period
def cap_grace(decision: GraceDecision, cap: int | None) -> GraceDecision:
    """``decision`` with its seconds clamped to the operator's ``--max-grace-seconds``."""
    if cap is None or decision.seconds <= cap:
        return decision
    return dataclasses.replace(
        decision,
        seconds=cap,
        reason=f"{decision.reason}; capped at {cap} s by the operator (--max-grace-seconds)",
    )


@dataclass(frozen=True)
class GraceOutcome:
    """status.gracePeriod's recommendation and condition GracePeriodSufficient."""

    grace_period: models.GraceStatus
    conditions: list[models.Condition]
    event: Event | None
    """A Warning when the grace turns (or stays, for a new reason) insufficient."""
    recommended: int
    """The next attempt's grace (also exported as a metric)."""


def grace_status(
    status: models.TrainingJobStatus,
    spec: models.TrainingJobSpec,
    max_grace_seconds: int | None,
    now: str,
    generation: int | None,
) -> GraceOutcome:
    """The next attempt's grace from the measurements so far, and whether the current (or last)
    attempt's grace sufficed: a kill at the grace deadline or a deadline too short to start a
    JIT save say no whatever the measurements."""
    last = (status.attempts or [])[-1] if status.attempts else None
    killed_grace = last.grace_seconds if last and last.killed and last.end_time else None
    decision = cap_grace(
        next_grace(spec.grace_period, status.timings, killed_grace), max_grace_seconds
    )
    gp = (status.grace_period or models.GraceStatus()).model_copy()
    gp.recommended = decision.seconds
    gp.reason = decision.reason
    gp.inputs = decision.inputs or None
    current = gp.current
    if last is not None and last.end_time is None:
        ok, message = grace_sufficiency(current, decision)
        reason = Reason.GRACE_SUFFICIENT if ok else Reason.GRACE_TOO_SHORT
    elif last is not None and last.reason == Reason.DEADLINE_TOO_SHORT:
        ok, reason = False, Reason.DEADLINE_TOO_SHORT
        message = (
            f"attempt {last.attempt} did not start its JIT save: it could not finish before "
            f"the deadline ({last.message}); the grace is not raised past what the node "
            "gives: save more often (status.checkpointInterval, spec.checkpoint.interval: auto)"
        )
    elif last is not None and last.killed:
        ok, reason = False, Reason.GRACE_KILLED
        message = (
            f"attempt {last.attempt} was SIGKILLed at its {last.grace_seconds} s grace "
            f"deadline; the next attempt gets {decision.seconds} s"
        )
    else:
        ok, message = grace_sufficiency(current, decision)
        reason = Reason.GRACE_SUFFICIENT if ok else Reason.GRACE_TOO_SHORT
    if decision.required is None and ok:
        reason = Reason.NOT_MEASURED
    before = cond.find_condition(status.conditions, cond.GRACE_PERIOD_SUFFICIENT)
    after = cond.set_condition(
        status.conditions,
        cond.GRACE_PERIOD_SUFFICIENT,
        "True" if ok else "False",
        reason,
        message,
        now,
        generation,
    )
    event: Event | None = None
    if not ok and (before is None or before.status != "False" or before.reason != reason):
        event = ("Warning", reason, message)
    return GraceOutcome(gp, after, event, decision.seconds)


# ------------------------------------------------------------------------------ phase shown
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


# ------------------------------------------------------------------------------ next pass
@dataclass(frozen=True)
class Wake:
    """When the next pass is due, before the periodic timer and the deadline."""

    delete: bool = False
    """spec.ttlSecondsAfterFinished passed: delete the TrainingJob, no further pass."""
    done: bool = False
    """Terminal and nothing due: no further pass for this object."""
    requeue_after: float | None = None
    periodic: bool = False
    """Nothing due: the periodic timer (budget.periodic_delay) decides."""
    busy: bool = False
    """The attempt's pods exist in a phase where time matters (scraping, lost nodes): on the
    poll timer, whose budget is shared among such jobs."""


def wake_after(
    phase: str,
    completion_time: str | None,
    ttl: int | None,
    due: float | None,
    has_pods: bool,
    now: float,
) -> Wake:
    """``due``: what the pass asked for (None: nothing). A finished job wakes when its TTL runs
    out; watch events wake the next pass otherwise, a timer only where time itself matters."""
    ttl_left = ttl_remaining(phase, completion_time, ttl, now)
    if ttl_left is not None and ttl_left <= 0:
        return Wake(delete=True, done=True)
    if ttl_left is not None:
        due = ttl_left if due is None else min(due, ttl_left)
    if phase in TERMINAL_PHASES and due is None:
        return Wake(done=True)
    if due is None:
        busy = has_pods and phase in ("Running", "Checkpointing", "Pending")
        return Wake(periodic=True, busy=busy)
    return Wake(requeue_after=due)


def deadline_wake(due: float | None, phase: str, deadline_left: float | None) -> float | None:
    """Wake at activeDeadlineSeconds even when nothing else happens (a job stuck Pending, a
    queued one with no timer of its own)."""
    if phase in TERMINAL_PHASES or deadline_left is None:
        return due
    at_deadline = max(0.5, deadline_left + 0.5)
    return at_deadline if due is None else min(due, at_deadline)


# ------------------------------------------------------------------------------ next attempt
def outcomes(status: models.TrainingJobStatus) -> dict[int, str | None]:
    """Each recorded attempt's outcome (None while it runs)."""
    return {rec.attempt: rec.outcome for rec in status.attempts or []}


@dataclass(frozen=True)
class AttemptPlan:
    """The attempt a create_attempt pass creates, and what it cleans up once its Job exists."""

    params: render.AttemptParams
    grace: GraceDecision
    old_jobs: list[dict[str, Any]]
    """Earlier attempts' Jobs to delete (the newest failed one is kept for its logs)."""
    old_pods: list[dict[str, Any]]
    """Earlier attempts' pods to release (all finished: the decision waited for that)."""
    previous: models.AttemptRecord | None
    """The newest attempt recorded before this one."""


def plan_attempt(
    snap: Snapshot,
    spec: models.TrainingJobSpec,
    status: models.TrainingJobStatus,
    recorded: bool,
    reported: models.CheckpointRef | None,
    storage: StorageSnapshot | None,
    max_grace_seconds: int | None,
) -> AttemptPlan:
    """The next attempt (or the current one again, when its Job is missing and it was never
    recorded): its grace from the measurements (doubled after a kill at the grace deadline,
    capped by the operator), where it resumes (storage's look ``storage``, already applied to
    ``status``, or the newest checkpoint ``reported`` before that) and its fence."""
    meta = snap.obj["metadata"]
    attempt = next_attempt_number(snap.attempt, recorded)
    # Earlier attempts' leftovers, cleaned up once this attempt's Job exists (in the
    # background, like an ended attempt's, which usually did it already). Their pods have
    # all finished (the decision waits for that; the Jobs fail on exit and never replace a
    # pod), so nothing of theirs can write checkpoints any more.
    old_jobs = [
        dict(j)
        for j in jobs_to_delete(snap.jobs, outcomes(status), attempt - 1, snap.pods_by_attempt)
    ]
    old_pods = [p for n, ps in snap.pods_by_attempt.items() if n < attempt for p in ps]
    last = (status.attempts or [])[-1] if status.attempts else None
    killed_grace = last.grace_seconds if last is not None and last.killed else None
    grace = cap_grace(
        next_grace(spec.grace_period, status.timings, killed_grace), max_grace_seconds
    )
    choice = resume_checkpoint(storage is not None, snapshot_ref(storage), reported)
    params = render.AttemptParams(
        attempt=attempt,
        grace_seconds=grace.seconds,
        resume_from=choice.resume_from,
        suspended=bool(spec.queue_name),
        start_step=choice.step,
        fence=attempt_fence(meta.get("creationTimestamp"), attempt),
        save_interval_seconds=auto_save_interval(spec, status),
    )
    return AttemptPlan(params, grace, old_jobs, old_pods, last)


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def adopted_params(existing: dict[str, Any], planned: render.AttemptParams) -> render.AttemptParams:
    """The attempt's Job exists already (ours: an earlier pass created it and did not record
    it): what it was created with, from its annotations, rules over this pass's plan."""
    ann = existing["metadata"].get("annotations") or {}
    return render.AttemptParams(
        attempt=planned.attempt,
        grace_seconds=int(ann.get(render.ANNOTATION_GRACE, planned.grace_seconds)),
        resume_from=ann.get(render.ANNOTATION_RESUME_FROM, planned.resume_from),
        suspended=planned.suspended,
        start_step=_int_or_none(ann.get(render.ANNOTATION_START_STEP)),
        fence=planned.fence,
    )


def start_attempt(
    status: models.TrainingJobStatus, name: str, params: render.AttemptParams, now: str
) -> None:
    """Record the attempt whose Job now exists in the pass's working status: its record (once),
    the current attempt, the start time, its grace; the backoff is over."""
    if find_record(status, params.attempt) is None:
        status.attempts = [
            *(status.attempts or []),
            models.AttemptRecord(
                attempt=params.attempt,
                job_name=render.job_name(name, params.attempt),
                start_time=now,
                start_step=params.start_step,
                resume_from=params.resume_from,
                grace_seconds=params.grace_seconds,
            ),
        ]
    status.attempt = params.attempt
    status.start_time = status.start_time or now
    status.next_attempt_after = None
    gp = status.grace_period or models.GraceStatus()
    gp.current = params.grace_seconds
    status.grace_period = gp


def attempt_created_message(name: str, params: render.AttemptParams, grace_reason: str) -> str:
    """The Event message of a created attempt."""
    return (
        f"attempt {params.attempt}: Job {render.job_name(name, params.attempt)}, grace "
        f"{params.grace_seconds} s ({grace_reason}), resume from "
        f"{params.resume_from or 'scratch'!r}"
    )


# ------------------------------------------------------------------------------ the action's status
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


DEACTIVATE_ON_RECORD: frozenset[str] = frozenset(
    {Reason.KUEUE_PREEMPTED, Reason.KUEUE_EVICTED, Reason.PODS_NEVER_READY, Reason.RESUMED_UNSEEN}
)
"""Reasons whose attempt's Workload is deactivated when the attempt is recorded: Kueue must
never re-admit that attempt (the next attempt brings a fresh Workload)."""


def held_pods(pods_by_attempt: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Pods of any attempt that still hold the attempt-record finalizer."""
    return [
        p
        for pods in pods_by_attempt.values()
        for p in pods
        if render.ATTEMPT_FINALIZER in (p["metadata"].get("finalizers") or [])
    ]


# ------------------------------------------------------------------------------ what is ours
def parse_spec_tolerant(
    raw: dict[str, Any] | None,
) -> tuple[models.TrainingJobSpec | None, str | None, str | None]:
    """(spec, why it is invalid, note). Fields this operator does not know (a newer CRD: version
    skew between CRD and operator) are dropped with a note rather than refused; anything else
    invalid is reported with the field, value and fix."""
    try:
        return models.parse_spec(raw), None, None
    except ValidationError as exc:
        unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
        if not unknown or len(unknown) != len(exc.errors()):
            return None, models.format_validation_error(exc), None
    pruned = json.loads(json.dumps(raw or {}))
    for loc in unknown:
        parent: Any = pruned
        for key in loc[:-1]:
            parent = parent[key]
        parent.pop(loc[-1], None)
    try:
        spec = models.parse_spec(pruned)
    except ValidationError as exc:
        return None, models.format_validation_error(exc), None
    shown = ", ".join("spec." + ".".join(str(p) for p in loc) for loc in unknown)
    return spec, None, f"ignored fields this operator does not know (a newer CRD?): {shown}"


def spec_of_job(job: dict[str, Any] | None) -> models.TrainingJobSpec | None:
    """The spec an attempt's Job was created from (its annotation), None when unknown."""
    raw = ((job or {}).get("metadata", {}).get("annotations") or {}).get(render.ANNOTATION_SPEC)
    if not raw:
        return None
    try:
        return models.parse_spec(json.loads(raw))
    except (ValueError, ValidationError):
        return None


def by_attempt(objs: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Objects by the attempt number of their label (unlabelled ones left out)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for obj in objs:
        raw = (obj["metadata"].get("labels") or {}).get(render.LABEL_ATTEMPT, "")
        if raw.isdigit():
            out.setdefault(int(raw), []).append(obj)
    return out


@dataclass(frozen=True)
class Children:
    """The TrainingJob's children among those labelled with its name."""

    jobs: dict[int, dict[str, Any]]
    """Its Jobs by attempt."""
    pods_by_attempt: dict[int, list[dict[str, Any]]]
    foreign_pods: list[dict[str, Any]]
    """Pods labelled with its name that are not its own: an earlier incarnation's."""


def owned_children(
    uid: str | None, jobs: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> Children:
    """Children are ours only by owner uid: a TrainingJob re-created under the same name must
    never adopt the previous incarnation's Jobs or pods (still being deleted)."""
    owned_jobs = [j for j in jobs if owned_by(j, uid)]
    job_uids = {j["metadata"].get("uid") for j in owned_jobs}
    ours = [p for p in pods if pod_owned(p, uid, job_uids)]
    return Children(
        jobs={n: js[0] for n, js in by_attempt(owned_jobs).items()},
        pods_by_attempt=by_attempt(ours),
        foreign_pods=[p for p in pods if not pod_owned(p, uid, job_uids)],
    )


@dataclass(frozen=True)
class PassSpec:
    """The spec a pass works with."""

    spec: models.TrainingJobSpec | None
    invalid: str | None
    """Why the TrainingJob cannot run at all (its name, or a spec invalid before any attempt)."""
    rejected: str | None
    """Why an edit after the job ran is rejected (``spec`` is then the current attempt's)."""
    note: str | None
    """Fields this operator does not know, dropped (logged)."""


def pass_spec(
    raw: dict[str, Any] | None, name_invalid: str | None, attempt: int, job: dict[str, Any] | None
) -> PassSpec:
    """An invalid spec before any attempt fails the job; an invalid edit of a job that has run
    is rejected, and the pass goes on with the spec the current attempt was created from (held
    between attempts until the spec is fixed)."""
    spec, spec_invalid, note = parse_spec_tolerant(raw)
    if spec_invalid is None:
        return PassSpec(spec, name_invalid, None, note)
    if attempt:
        return PassSpec(spec_of_job(job), name_invalid, spec_invalid, note)
    return PassSpec(spec, name_invalid or spec_invalid, None, note)


def left_by_earlier_incarnation(existing: dict[str, Any], tj_name: str) -> bool:
    """A child name is taken by an object owned by a TrainingJob of the same name (another
    uid): a deleted incarnation's, which garbage collection removes (waited for, never a
    refusal)."""
    refs = existing["metadata"].get("ownerReferences") or []
    return any(r.get("kind") == models.KIND and r.get("name") == tj_name for r in refs)


# ------------------------------------------------------------------------------ Workloads
def deactivation_patch(workload: dict[str, Any]) -> dict[str, Any] | None:
    """The merge patch that deactivates an attempt's Workload (None: inactive already). Marked
    as ours: an inactive Workload without the mark is an administrator's (or Kueue's) and
    suspends the TrainingJob (classify.workload_deactivated). A victim's priority boost must not
    follow its Workload back into the queue."""
    if (workload.get("spec") or {}).get("active") is False:
        return None
    annotations: dict[str, Any] = {DEACTIVATED_BY_OPERATOR_ANNOTATION: "true"}
    if BOOST_ANNOTATION in (workload["metadata"].get("annotations") or {}):
        annotations[BOOST_ANNOTATION] = None
    return {"metadata": {"annotations": annotations}, "spec": {"active": False}}
