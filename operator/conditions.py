"""Condition types, reasons (also used as Event reasons) and a pure condition setter."""

from __future__ import annotations

from typing import Literal

from preemptible_operator.models import Condition

__all__ = [
    "ADMITTED",
    "ALL_TYPES",
    "CHECKPOINTING",
    "COMPLETE",
    "CREATE_REFUSED",
    "FAILED",
    "GRACE_PERIOD_SUFFICIENT",
    "NODE_UNREACHABLE",
    "PREEMPTED",
    "PREEMPTION_REASONS",
    "RUNNING",
    "SUCCEEDED",
    "SUSPENDED",
    "Event",
    "Reason",
    "find_condition",
    "lifecycle_conditions",
    "set_condition",
]

ADMITTED = "Admitted"
RUNNING = "Running"
CHECKPOINTING = "Checkpointing"
PREEMPTED = "Preempted"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
GRACE_PERIOD_SUFFICIENT = "GracePeriodSufficient"
# True while the apiserver refuses the attempt's Service, Job or pods (issue 30).
CREATE_REFUSED = "CreateRefused"
# What `kubectl wait --for=condition=...` users know from batch/v1 Job (and Kubeflow's jobs):
# Complete and Failed become True when the job ends, Suspended while it is suspended.
COMPLETE = "Complete"
SUSPENDED = "Suspended"
# True while an attempt's pod is stuck on a NotReady node past spec.unreachableNode's bound.
NODE_UNREACHABLE = "NodeUnreachable"
ALL_TYPES = (
    ADMITTED,
    RUNNING,
    CHECKPOINTING,
    PREEMPTED,
    SUSPENDED,
    SUCCEEDED,
    COMPLETE,
    FAILED,
    GRACE_PERIOD_SUFFICIENT,
    CREATE_REFUSED,
    NODE_UNREACHABLE,
)


class Reason:
    """Condition and Event reasons (CamelCase constants)."""

    # lifecycle
    ATTEMPT_CREATED = "AttemptCreated"
    QUEUED = "Queued"
    ADMITTED = "Admitted"
    STARTED = "Started"
    POD_PENDING = "PodsPending"
    COMPLETED = "Completed"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    RESUME_FELL_BACK = "ResumeFellBack"
    # interruptions: preemptions (never count against maxRestarts)
    KUEUE_PREEMPTED = "KueuePreempted"
    KUEUE_EVICTED = "KueueEvicted"
    POD_EVICTED = "PodEvicted"
    SCHEDULER_PREEMPTED = "SchedulerPreempted"
    NODE_LOST = "NodeLost"
    NODE_SHUTDOWN = "NodeShutdown"
    RUNTIME_PREEMPTED = "RuntimePreempted"
    # the runtime did not start a JIT save that could not finish before its deadline
    DEADLINE_TOO_SHORT = "DeadlineTooShort"
    # interruptions: real failures
    TRAINING_FAILED = "TrainingFailed"
    JOB_FAILED = "JobFailed"
    RESTARTS_EXHAUSTED = "RestartsExhausted"
    # spec.activeDeadlineSeconds passed since the first attempt started
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    # more preemptions than spec.maxPreemptions
    PREEMPTION_LIMIT_EXCEEDED = "PreemptionLimitExceeded"
    # spec.ttlSecondsAfterFinished passed: the operator deletes the finished TrainingJob
    TTL_EXPIRED = "TTLExpired"
    INVALID_SPEC = "InvalidSpec"
    # bookkeeping
    CHECKPOINTING = "Checkpointing"
    ATTEMPT_RECORDED = "AttemptRecorded"
    REQUEUED = "Requeued"
    BACKOFF = "RestartBackoff"
    GRACE_SUFFICIENT = "GraceSufficient"
    GRACE_TOO_SHORT = "GraceTooShort"
    GRACE_KILLED = "KilledAtGraceDeadline"
    NOT_MEASURED = "NotMeasured"
    LOST_STEPS = "LostSteps"
    CHECKPOINT_COMPLETE = "CheckpointComplete"
    # review fixes (issue 17)
    PREVIOUS_PODS_STOPPING = "PreviousPodsStopping"
    OOM_KILLED = "OOMKilled"
    PEER_FAILED = "PeerFailed"
    PODS_NEVER_READY = "PodsNeverReady"
    SPEC_CHANGE_REJECTED = "SpecChangeRejected"
    CHECKPOINT_INTERVAL = "CheckpointIntervalRecommended"
    # interruption classification (issue 30)
    KUBELET_EVICTED = "KubeletEvicted"
    """The kubelet evicted a pod for node pressure or its own ephemeral-storage/emptyDir limit:
    a failure (counts against maxRestarts), never a reason to raise the grace."""
    WORKLOAD_DEACTIVATED = "WorkloadDeactivated"
    """Someone other than the operator (an administrator, or Kueue at its requeuing limit)
    deactivated the attempt's Kueue Workload: the TrainingJob is suspended, not requeued."""
    # refused children (issue 30): condition CreateRefused, Warning Events
    NAME_TAKEN = "ChildNameTaken"
    CHILD_INVALID = "ChildInvalid"
    CHILD_FORBIDDEN = "ChildForbidden"
    PODS_REFUSED = "PodsRefused"
    CREATED = "Created"
    # failure policy and unreachable nodes (issue 30)
    FAILED_BY_POLICY = "FailedByPolicy"
    """A failed attempt matched a spec.failurePolicy rule whose action is FailJob."""
    FAILURE_IGNORED = "FailureIgnored"
    """A failed attempt matched a rule whose action is Ignore: restarted, not counted."""
    OUT_OF_SERVICE_NEEDED = "OutOfServiceTaintNeeded"
    """An attempt's pod has been stuck on a NotReady node past spec.unreachableNode's bound:
    an administrator must taint the node out-of-service or delete it."""
    NODES_REACHABLE = "NodesReachable"
    # lifecycle fixes (issue 39)
    PREVIOUS_ATTEMPT_STOPPING = "PreviousAttemptStopping"
    """Pods or a Job of an earlier attempt may still run: the next attempt waits for them."""
    RESUMED_UNSEEN = "ResumedUnseen"
    """The attempt's Job was suspended and resumed while the operator did not watch (a Kueue
    eviction and re-admission): its new pods restarted from its old checkpoint. The attempt
    ends as preempted; the next one resumes from the newest checkpoint."""
    # elastic capacity (issue 40, docs/elastic.md)
    SCALED_DOWN = "ScaledDown"
    """An elastic attempt starts on fewer pods than the previous one (or than spec.numNodes)."""
    SCALED_UP = "ScaledUp"
    """An elastic attempt starts on more pods than the previous one."""
    RESIZING = "Resizing"
    """Kueue admitted a bigger slice of an elastic job's Workload: the attempt stops at a
    checkpoint and the next one starts bigger (neither a preemption nor a failure)."""
    GROW_REQUESTED = "GrowRequested"
    """An elastic attempt runs below its largest size and a restart would pay: the operator
    asks Kueue for a bigger replacement slice of its Workload."""
    QUOTA_UNUSED = "AdmittedQuotaUnused"
    """Kueue admitted more pods than the largest size that keeps the global batch: the rest of
    the admitted quota stays reserved but unused for this attempt."""


PREEMPTION_REASONS = frozenset(
    {
        Reason.KUEUE_PREEMPTED,
        Reason.KUEUE_EVICTED,
        Reason.POD_EVICTED,
        Reason.SCHEDULER_PREEMPTED,
        Reason.NODE_LOST,
        Reason.NODE_SHUTDOWN,
        Reason.RUNTIME_PREEMPTED,
        Reason.DEADLINE_TOO_SHORT,
        Reason.RESUMED_UNSEEN,
    }
)


def find_condition(conditions: list[Condition] | None, ctype: str) -> Condition | None:
    """The condition of type ``ctype``, or None."""
    for cond in conditions or []:
        if cond.type == ctype:
            return cond
    return None


def set_condition(
    conditions: list[Condition] | None,
    ctype: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    now: str,
    generation: int | None = None,
) -> list[Condition]:
    """Return the conditions with ``ctype`` set. lastTransitionTime changes only when the status
    does (Kubernetes convention), so repeated reconcile passes do not churn the object."""
    result: list[Condition] = []
    found = False
    for cond in conditions or []:
        if cond.type != ctype:
            result.append(cond)
            continue
        found = True
        changed = cond.status != status
        result.append(
            Condition(
                type=ctype,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now if changed else cond.last_transition_time,
                observed_generation=generation,
            )
        )
    if not found:
        result.append(
            Condition(
                type=ctype,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=now,
                observed_generation=generation,
            )
        )
    order = {t: i for i, t in enumerate(ALL_TYPES)}
    return sorted(result, key=lambda c: order.get(c.type, len(order)))


def lifecycle_conditions(
    conditions: list[Condition] | None,
    phase: str,
    now: str,
    generation: int | None = None,
) -> list[Condition] | None:
    """Complete and Suspended for ``phase`` (Failed is set with its reason where the job fails).

    Complete is True/Completed once the job succeeded and is never written before (as batch/v1
    Job: `kubectl wait --for=condition=Complete` waits for it to appear). Suspended is
    True/Suspended while the phase is Suspended (the pods are gone), and False/Resumed once the
    job leaves it; a job never suspended has none."""
    c = conditions
    if phase == "Succeeded":
        c = set_condition(
            c, COMPLETE, "True", Reason.COMPLETED, "training finished", now, generation
        )
    suspended = find_condition(c, SUSPENDED)
    if phase == "Suspended":
        c = set_condition(
            c, SUSPENDED, "True", Reason.SUSPENDED, "spec.suspend is true; no pods", now, generation
        )
    elif suspended is not None and suspended.status == "True":
        c = set_condition(
            c, SUSPENDED, "False", Reason.RESUMED, "spec.suspend is false", now, generation
        )
    return c


Event = tuple[str, str, str]
"""(type, reason, message) of an Event on the TrainingJob."""
