"""What one reconcile pass observed (``Snapshot``) and the state machine's inputs read from it:
how the current attempt stands (``interruption_of``), whether it starts now, which earlier
attempts still run, and ``phases.PhaseInputs``. Pure: the time and every observation are
arguments (tests/unit/operator/test_observation.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from preemptible_operator import models
from preemptible_operator.accounting import limited_preemptions
from preemptible_operator.children import (
    attempt_pods_finished,
    job_terminal,
    no_pod_can_follow,
    restarted_pods,
)
from preemptible_operator.classify import (
    Interruption,
    attempt_started,
    classify_interruption,
    pending_detail,
    pod_finished,
)
from preemptible_operator.conditions import Reason
from preemptible_operator.elastic_attempt import resize_interruption
from preemptible_operator.failure_policy import counted_failures
from preemptible_operator.phases import PhaseInputs, deadline_remaining, next_attempt_number
from preemptible_operator.scrape import RuntimeMetrics
from preemptible_operator.timestamps import parse_rfc3339

__all__ = [
    "InterruptionView",
    "Snapshot",
    "earlier_attempts_active",
    "interruption_of",
    "phase_inputs",
    "running_pods",
    "starts_now",
]


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
    """Rank 0's /metrics, read by periodic passes while the current attempt has running pods
    (``answered`` False: rank 0 runs but did not answer)."""
    pending_slices: tuple[dict[str, Any], ...] = ()
    """An elastic job's newer Workload slices not finished (a grow asked of Kueue); ``workload``
    is then the one its current attempt runs under (elastic_attempt.slices)."""


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
    if spec.elastic is not None:
        resized = resize_interruption(
            snap.workload, interruption, record.nodes if record is not None else None
        )
        if resized is not None:
            return InterruptionView(resized)
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
