"""Pure classification of an attempt from its Job, pods, Kueue Workload and nodes.

Inputs are plain dicts in the apiserver's JSON shape (camelCase), as the Kubernetes client's
``sanitize_for_serialization`` produces them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from preemptible_operator.conditions import Reason
from preemptible_operator.render import CONTAINER_NAME
from preemptible_operator.timestamps import parse_rfc3339
from trainer_runtime import protocol

__all__ = [
    "ContainerEnd",
    "Interruption",
    "Outcome",
    "classify_interruption",
    "container_end",
    "deadline_too_short",
    "is_kueue_admitted",
    "job_condition",
    "killed_at_grace",
    "pending_detail",
    "pod_finished",
    "pod_sigterm_to_exit",
    "workload_condition",
]

Outcome = Literal["Active", "Succeeded", "Preempted", "Failed", "Suspended"]

SIGKILL_EXIT = 128 + 9

START_FAILURE_EVICTIONS = frozenset({"PodsReadyTimeout", "AdmissionCheck"})
"""Kueue Workload eviction reasons that, for an attempt whose pods never ran, mean it could not
start (rather than that it was preempted)."""

# Waiting reasons of a container that will not start without a change (kubelet's names).
_STUCK_WAITING = frozenset(
    {
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)

_DISRUPTION_REASONS = {
    "EvictionByEvictionAPI": Reason.POD_EVICTED,
    "PreemptionByScheduler": Reason.SCHEDULER_PREEMPTED,
    "PreemptionByKubeScheduler": Reason.SCHEDULER_PREEMPTED,
    "DeletionByTaintManager": Reason.NODE_LOST,
    "DeletionByPodGC": Reason.NODE_LOST,
    "TerminationByKubelet": Reason.NODE_SHUTDOWN,
}


@dataclass(frozen=True)
class Interruption:
    """How an attempt stands: still active, or over with a reason."""

    outcome: Outcome
    reason: str
    message: str = ""

    @property
    def over(self) -> bool:
        return self.outcome != "Active"


@dataclass(frozen=True)
class ContainerEnd:
    """The training container's terminated state in one pod."""

    pod: str
    index: int | None
    exit_code: int | None
    reason: str | None
    message: protocol.TerminationMessage | None
    raw_message: str | None = None
    grace_seconds: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    observed_sigterm_to_exit: float | None = None
    """SIGTERM-to-exit read from the pod object (pod_sigterm_to_exit), whole seconds."""

    @property
    def oom(self) -> bool:
        """Killed by the OOM killer (the kubelet reports reason OOMKilled)."""
        return self.reason == "OOMKilled"

    @property
    def failed_on_its_own(self) -> bool:
        """Its termination message says it failed (not for a peer): under our launcher a worker
        SIGKILLed on its own (the OOM killer of one process) ends the pod with 137 and this
        message, which a pod killed at the grace deadline could not have written."""
        msg = self.message
        return msg is not None and msg.reason == "failed" and not msg.peer_gone

    @property
    def killed(self) -> bool:
        """SIGKILLed by someone other than the OOM killer (e.g. at the grace deadline)."""
        return self.exit_code == SIGKILL_EXIT and not self.oom and not self.failed_on_its_own

    @property
    def stopped_for_preemption(self) -> bool:
        """Its runtime says it stopped for a preemption (reason ``preempted`` or
        ``deadline_too_short``), whatever the exit code: a launcher that does not map its
        workers' exit 75 ends with its own (torchrun exits 1, accelerate launch 128 + the signal),
        and only the pod's main process wrote the message."""
        return self.message is not None and self.message.reason in (
            "preempted",
            protocol.REASON_DEADLINE_TOO_SHORT,
        )

    @property
    def preempted_with_checkpoint(self) -> bool:
        """A non-zero exit after a complete JIT checkpoint (``preempted``, ``complete``)."""
        msg = self.message
        return (
            self.exit_code not in (0, None)
            and not self.oom
            and msg is not None
            and msg.reason == "preempted"
            and msg.complete
        )

    @property
    def sigterm_to_exit(self) -> float | None:
        """The longer of the runtime's own measure (termination message) and what the pod object
        shows: a launcher that does not measure to the pod's end (plain torchrun, accelerate
        launch) reports only its main worker's time."""
        own = self.message.sigterm_to_exit_seconds if self.message is not None else None
        values = [v for v in (own, self.observed_sigterm_to_exit) if v is not None]
        return max(values) if values else None

    @property
    def peer_failed(self) -> bool:
        """Stopped because another rank was gone (the runtime's EXIT_PEER_FAILED, or a message
        saying so under a launcher that exits with its own code): the cause is that other
        rank's end, not this one."""
        if self.oom:
            return False
        if self.exit_code == protocol.EXIT_PEER_FAILED:
            return True
        return (
            self.exit_code not in (0, None)
            and self.message is not None
            and bool(self.message.peer_gone)
        )

    @property
    def real_failure(self) -> bool:
        """Failed on its own: OOM, or a non-zero exit that is neither a SIGKILL, the runtime's
        preemption exit (or a launcher's exit after its runtime stopped for a preemption), nor
        an exit for another rank's end."""
        if self.oom:
            return True
        if self.exit_code == SIGKILL_EXIT:
            return self.failed_on_its_own
        if self.exit_code in (0, None, protocol.EXIT_PREEMPTED):
            return False
        return not (self.peer_failed or self.stopped_for_preemption)


def killed_at_grace(ends: Iterable[ContainerEnd]) -> bool:
    """Whether an attempt's ends show its grace period was too short: a rank was SIGKILLed (not
    by the OOM killer) and no rank failed for real. When one rank fails, the others wait for it
    at their next collective until they are killed (or, with the runtime's peer watch, exit
    EXIT_PEER_FAILED); that says nothing about the grace period. A rank that exited
    EXIT_PEER_FAILED after another was SIGKILLed does not hide that SIGKILL."""
    ends = list(ends)
    return any(e.killed for e in ends) and not any(e.real_failure for e in ends)


def _conditions(obj: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list(((obj or {}).get("status") or {}).get("conditions") or [])


def job_condition(job: Mapping[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    """The Job's condition of ``ctype`` when its status is True."""
    for cond in _conditions(job):
        if cond.get("type") == ctype and cond.get("status") == "True":
            return cond
    return None


def workload_condition(workload: Mapping[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    """The Kueue Workload's condition of ``ctype`` when True."""
    return job_condition(workload, ctype)


def is_kueue_admitted(workload: Mapping[str, Any] | None) -> bool:
    """Whether Kueue currently admits the Workload."""
    return workload_condition(workload, "Admitted") is not None


def _pod_condition(pod: Mapping[str, Any], ctype: str) -> dict[str, Any] | None:
    return job_condition(pod, ctype)


def _index(pod: Mapping[str, Any]) -> int | None:
    meta = pod.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get("batch.kubernetes.io/job-completion-index")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def container_end(pod: Mapping[str, Any]) -> ContainerEnd | None:
    """The training container's terminated state, or None while it has not terminated."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        if status.get("name") != CONTAINER_NAME:
            continue
        terminated = (status.get("state") or {}).get("terminated") or (
            status.get("lastState") or {}
        ).get("terminated")
        if not terminated:
            return None
        raw = terminated.get("message")
        return ContainerEnd(
            pod=(pod.get("metadata") or {}).get("name", ""),
            index=_index(pod),
            exit_code=terminated.get("exitCode"),
            reason=terminated.get("reason"),
            message=protocol.read_termination_message(raw),
            raw_message=raw,
            grace_seconds=(pod.get("spec") or {}).get("terminationGracePeriodSeconds"),
            observed_sigterm_to_exit=pod_sigterm_to_exit(pod, terminated),
        )
    return None


def pod_sigterm_to_exit(
    pod: Mapping[str, Any], terminated: Mapping[str, Any] | None = None
) -> float | None:
    """Seconds from the SIGTERM of a graceful deletion to the container's end, from the pod
    object alone: the deletion sets ``deletionTimestamp`` = the time of the delete request (when
    the kubelet sends SIGTERM) + ``deletionGracePeriodSeconds``, and the container's
    ``finishedAt`` is its end. Both have one second's resolution, so the result is within a
    second of the truth either way. None when the pod was not deleted, or its container had
    ended before the deletion (its end was not caused by it)."""
    meta = pod.get("metadata") or {}
    deleted = parse_rfc3339(meta.get("deletionTimestamp"))
    grace = meta.get("deletionGracePeriodSeconds")
    if terminated is None:
        end = container_end(pod)
        return end.observed_sigterm_to_exit if end is not None else None
    finished = parse_rfc3339(terminated.get("finishedAt"))
    if deleted is None or grace is None or finished is None:
        return None
    took = finished - (deleted - float(grace))
    return took if took >= 0 else None


def pod_finished(
    pod: Mapping[str, Any],
    node_ready: Mapping[str, bool] | None = None,
    now: float | None = None,
) -> bool:
    """Whether a pod can no longer run or write: terminal phase, every container terminated,
    deleted before it was bound, or deleted while bound to a node that no longer exists (absent
    from ``node_ready``: the pod garbage collector removes such pods). A pod deleted on a node
    that is NotReady but still there is not finished, however long ago its deadline passed: the
    node may be partitioned, not dead, and a kubelet that never received the deletion still runs
    the pod and writes checkpoints. As with StatefulSets, only the node's return (its kubelet
    reports the pod) or its removal (by the cloud provider or an administrator) settles it.
    ``now`` is kept for callers; the decision does not depend on it."""
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    statuses = status.get("containerStatuses") or []
    if statuses and all((s.get("state") or {}).get("terminated") for s in statuses):
        return True
    deletion = (pod.get("metadata") or {}).get("deletionTimestamp")
    node = (pod.get("spec") or {}).get("nodeName")
    if deletion is not None and not node:
        return True
    if deletion is None or node_ready is None:
        return False
    return node not in node_ready


def pending_detail(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """Why the pods of an attempt do not run yet, as the cluster says it: a container stuck
    waiting (ImagePullBackOff, CreateContainerConfigError, ...) or the scheduler's reason
    (``PodScheduled`` False: e.g. unbound PersistentVolumeClaims, no node fits). None when
    nothing is known to be wrong."""
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name")
        status = pod.get("status") or {}
        for cs in status.get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in _STUCK_WAITING:
                detail = f": {waiting['message']}" if waiting.get("message") else ""
                return f"pod {name}: {waiting['reason']}{detail}"
        for cond in status.get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                detail = f": {cond['message']}" if cond.get("message") else ""
                return f"pod {name}: {cond.get('reason') or 'Unschedulable'}{detail}"
    return None


def _disruption(pods: Iterable[Mapping[str, Any]]) -> tuple[str, str] | None:
    for pod in pods:
        cond = _pod_condition(pod, "DisruptionTarget")
        if cond is not None:
            reason = _DISRUPTION_REASONS.get(cond.get("reason", ""), Reason.POD_EVICTED)
            name = (pod.get("metadata") or {}).get("name")
            detail = cond.get("message") or cond.get("reason") or "disruption"
            return reason, f"pod {name}: {detail}"
    return None


def _node_lost(
    pods: Iterable[Mapping[str, Any]], node_ready: Mapping[str, bool] | None
) -> tuple[str, str] | None:
    for pod in pods:
        status = pod.get("status") or {}
        name = (pod.get("metadata") or {}).get("name")
        node = (pod.get("spec") or {}).get("nodeName")
        if status.get("reason") == "NodeLost" or status.get("phase") == "Unknown":
            return Reason.NODE_LOST, f"pod {name} lost with node {node}"
        finished = status.get("phase") in ("Succeeded", "Failed")
        if node and node_ready is not None and not node_ready.get(node, False) and not finished:
            return Reason.NODE_LOST, f"node {node} of pod {name} is not ready or gone"
    return None


def _kueue_eviction(
    job: Mapping[str, Any] | None, workload: Mapping[str, Any] | None, was_admitted: bool
) -> tuple[str, str] | None:
    for ctype in ("Preempted", "Evicted"):
        cond = workload_condition(workload, ctype)
        if cond is not None:
            reason = cond.get("reason") or ctype
            if ctype == "Evicted" and reason in START_FAILURE_EVICTIONS and not was_admitted:
                # Not a preemption: the pods never ran (a bad image under waitForPodsReady, a
                # rejected admission check). Counted as a failure, so maxRestarts and the
                # restart backoff apply instead of an immediate requeue forever.
                return Reason.PODS_NEVER_READY, (
                    f"Kueue evicted the attempt ({reason}) before any pod ran: "
                    f"{cond.get('message') or ''}"
                ).rstrip(": ")
            kind = (
                Reason.KUEUE_PREEMPTED
                if "Preempt" in reason or ctype == "Preempted"
                else (Reason.KUEUE_EVICTED)
            )
            return kind, f"Kueue {ctype} ({reason}): {cond.get('message') or ''}".rstrip(": ")
    # Kueue suspended an admitted Job but the Workload shows no reason (e.g. it was deleted).
    if was_admitted and job is not None and (job.get("spec") or {}).get("suspend"):
        return Reason.KUEUE_EVICTED, "the Job was suspended after admission"
    return None


def deadline_too_short(ends: Iterable[ContainerEnd]) -> Interruption | None:
    """A pod whose runtime exited without starting a save that could not finish before its
    deadline (termination reason ``deadline_too_short``): a preemption whose work since the last
    complete checkpoint is lost, not a failure, and not a grace to double."""
    for end in ends:
        if end.message is not None and end.message.reason == protocol.REASON_DEADLINE_TOO_SHORT:
            detail = end.message.message or "the JIT save could not finish before the deadline"
            return Interruption("Preempted", Reason.DEADLINE_TOO_SHORT, f"pod {end.pod}: {detail}")
    return None


def classify_interruption(
    job: Mapping[str, Any] | None,
    pods: list[Mapping[str, Any]],
    workload: Mapping[str, Any] | None = None,
    *,
    node_ready: Mapping[str, bool] | None = None,
    was_admitted: bool = False,
    user_suspended: bool = False,
) -> Interruption:
    """Tell apart success, the kinds of preemption and a real failure.

    ``was_admitted``: the attempt had been admitted/started before (from the TrainingJob status),
    so a suspended Job means Kueue took it back. ``user_suspended``: the user asked to suspend.
    Precedence: success; the user's suspension; Kueue eviction; the runtime's deadline_too_short
    exit; a pod disruption condition;
    node loss; the runtime's preemption exit code; otherwise a non-zero exit or a failed Job is a
    real failure.
    """
    ends = [e for e in (container_end(p) for p in pods) if e is not None]
    if job_condition(job, "Complete") is not None or (
        ends
        and job is not None
        and len(ends) >= int((job.get("spec") or {}).get("completions") or 1)
        and all(e.exit_code == 0 for e in ends)
    ):
        return Interruption("Succeeded", Reason.COMPLETED, "all ranks finished training")
    if user_suspended:
        return Interruption("Suspended", Reason.SUSPENDED, "suspended by the user (spec.suspend)")
    kueue = _kueue_eviction(job, workload, was_admitted)
    if kueue is not None:
        outcome: Outcome = "Failed" if kueue[0] == Reason.PODS_NEVER_READY else "Preempted"
        return Interruption(outcome, *kueue)
    # After Kueue's eviction (whose Workload the operator must deactivate), before the node's
    # reasons: on a spot reclaim the node's notice is what the save did not fit.
    too_short = deadline_too_short(ends)
    if too_short is not None:
        return too_short
    disruption = _disruption(pods)
    if disruption is not None:
        return Interruption("Preempted", *disruption)
    lost = _node_lost(pods, node_ready)
    if lost is not None:
        return Interruption("Preempted", *lost)
    preempted_exit = [e for e in ends if e.exit_code == protocol.EXIT_PREEMPTED]
    if preempted_exit:
        first = preempted_exit[0]
        return Interruption(
            "Preempted",
            Reason.RUNTIME_PREEMPTED,
            f"pod {first.pod} exited {protocol.EXIT_PREEMPTED} after a JIT checkpoint",
        )
    # A launcher that does not map its workers' exit 75 (plain torchrun: 1, accelerate launch:
    # 128 + the signal) around a runtime that committed its JIT checkpoint: a preemption all the
    # same, unless a real failure is there too.
    relaunched = [e for e in ends if e.preempted_with_checkpoint]
    if relaunched and not any(e.real_failure for e in ends):
        first = relaunched[0]
        return Interruption(
            "Preempted",
            Reason.RUNTIME_PREEMPTED,
            f"pod {first.pod} exited {first.exit_code} after a complete JIT checkpoint "
            f"(step {first.message.step if first.message else '?'}; the exit code is its "
            "launcher's, the termination message its runtime's)",
        )
    failed = [e for e in ends if e.exit_code not in (0, None)]
    # The root cause first: an OOM kill, then a rank that failed on its own, then the ranks
    # killed while they waited for it, last those that exited because another rank was gone.
    failed.sort(key=lambda e: (not e.oom, not e.real_failure, e.peer_failed))
    if failed and failed[0].oom:
        first = failed[0]
        return Interruption(
            "Failed",
            Reason.OOM_KILLED,
            f"pod {first.pod} was OOMKilled (exit {first.exit_code}): raise "
            "resourcesPerNode.limits.memory or lower the batch size",
        )
    if failed:
        first = failed[0]
        detail = (
            first.message.message
            if first.message is not None and first.message.message
            else (first.raw_message or first.reason or "").strip()[-300:]
        )
        return Interruption(
            "Failed",
            Reason.TRAINING_FAILED,
            f"pod {first.pod} exited {first.exit_code}" + (f": {detail}" if detail else ""),
        )
    failed_cond = job_condition(job, "Failed")
    if failed_cond is not None:
        return Interruption(
            "Failed",
            Reason.JOB_FAILED,
            f"Job failed ({failed_cond.get('reason')}): {failed_cond.get('message') or ''}".rstrip(
                ": "
            ),
        )
    return Interruption("Active", Reason.STARTED, "")
