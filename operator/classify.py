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
    "DEACTIVATED_BY_OPERATOR_ANNOTATION",
    "ContainerEnd",
    "Interruption",
    "Outcome",
    "attempt_started",
    "classify_interruption",
    "container_end",
    "deadline_too_short",
    "grace_deadline",
    "is_kueue_admitted",
    "job_condition",
    "killed_at_grace",
    "kubelet_eviction",
    "pending_detail",
    "pod_finished",
    "pod_sigterm_to_exit",
    "workload_condition",
    "workload_deactivated",
]

Outcome = Literal["Active", "Succeeded", "Preempted", "Failed", "Suspended"]

SIGKILL_EXIT = 128 + 9

START_FAILURE_EVICTIONS = frozenset({"PodsReadyTimeout", "AdmissionCheck"})
"""Kueue Workload eviction reasons that, for an attempt whose pods never all ran together, mean
it could not start (rather than that it was preempted)."""

DEACTIVATION_EVICTIONS = frozenset({"InactiveWorkload", "Deactivated"})
"""Kueue Workload eviction reasons for a Workload whose ``spec.active`` was set false (by an
administrator, or by Kueue itself at its requeuing limit)."""

DEACTIVATED_BY_OPERATOR_ANNOTATION = "preemptible.dev/deactivated-by-operator"
"""Set on a Workload in the same patch as the operator's own ``spec.active: false`` (after
Kueue evicted the attempt), so that deactivation is never mistaken for an administrator's."""

GRACE_DEADLINE_SLACK_SECONDS = 2.0
"""How much earlier than its grace deadline a container may seem to end and still count as
killed at it: both stamps have one second's resolution, and the node's clock (finishedAt) and
the API server's (deletionTimestamp) may differ a little."""

CONTAINER_STATUS_UNKNOWN = "ContainerStatusUnknown"
"""The kubelet's terminated reason (exit 137) for a container it can no longer find, e.g.
after its node rebooted: nobody killed it, the node lost it."""

# Words of the kubelet's eviction messages (node pressure, a pod's or container's
# ephemeral-storage limit, an emptyDir over its sizeLimit); a graceful node shutdown says
# "node shutdown" instead.
_EVICTION_WORDS = ("low on resource", "ephemeral", "exceeds the limit", "node had condition")

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
    at_grace_deadline: bool = False
    """Someone asked the pod to stop (it was deleted, or has a DisruptionTarget condition) and
    its container ended at or after that termination's grace deadline (grace_deadline)."""
    kubelet_evicted: str | None = None
    """The kubelet's eviction message when it evicted the pod (kubelet_eviction)."""
    finished_at: float | None = None
    """The container's end (finishedAt, seconds since the epoch; one second's resolution)."""

    @property
    def oom(self) -> bool:
        """Killed by the OOM killer (the kubelet reports reason OOMKilled)."""
        return self.reason == "OOMKilled"

    @property
    def status_unknown(self) -> bool:
        """The kubelet lost the container (ContainerStatusUnknown, exit 137: e.g. its node
        rebooted): neither a crash nor a kill at the grace deadline."""
        return self.reason == CONTAINER_STATUS_UNKNOWN

    @property
    def failed_on_its_own(self) -> bool:
        """Its termination message says it failed (not for a peer): under our launcher a worker
        SIGKILLed on its own (the OOM killer of one process) ends the pod with 137 and this
        message, which a pod killed at the grace deadline could not have written."""
        msg = self.message
        return msg is not None and msg.reason == "failed" and not msg.peer_gone

    @property
    def killed(self) -> bool:
        """SIGKILLed at the grace deadline of a termination someone asked for: exit 137, not
        by the OOM killer, not a worker's own kill (failed_on_its_own), not a container the
        kubelet lost (ContainerStatusUnknown), not a kubelet eviction (its grace is 0 or the
        kubelet's own maximum, never the pod's), and the pod was deleted or marked
        DisruptionTarget and ended at or after that deadline. Only this says the grace was
        too short."""
        return (
            self.exit_code == SIGKILL_EXIT
            and not self.oom
            and not self.failed_on_its_own
            and not self.status_unknown
            and self.kubelet_evicted is None
            and self.at_grace_deadline
        )

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
            # Killed by someone (at a grace deadline, by the kubelet, lost with its node)
            # unless its own message says one of its workers was killed on its own.
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
        deadline = grace_deadline(pod)
        finished = parse_rfc3339(terminated.get("finishedAt"))
        return ContainerEnd(
            pod=(pod.get("metadata") or {}).get("name", ""),
            index=_index(pod),
            exit_code=terminated.get("exitCode"),
            reason=terminated.get("reason"),
            message=protocol.read_termination_message(raw),
            raw_message=raw,
            grace_seconds=(pod.get("spec") or {}).get("terminationGracePeriodSeconds"),
            observed_sigterm_to_exit=pod_sigterm_to_exit(pod, terminated),
            at_grace_deadline=deadline is not None
            and finished is not None
            and finished >= deadline - GRACE_DEADLINE_SLACK_SECONDS,
            kubelet_evicted=kubelet_eviction(pod),
            finished_at=finished,
        )
    return None


def grace_deadline(pod: Mapping[str, Any]) -> float | None:
    """When a termination someone asked for gives way to SIGKILL: the pod's
    ``deletionTimestamp`` (the delete request's time plus its grace), else the time of its
    DisruptionTarget condition plus its ``terminationGracePeriodSeconds`` (a termination by
    the kubelet itself, e.g. a graceful node shutdown). None when nobody asked the pod to stop:
    then a SIGKILL says nothing about the grace period."""
    deleted = parse_rfc3339((pod.get("metadata") or {}).get("deletionTimestamp"))
    if deleted is not None:
        return deleted
    disruption = _pod_condition(pod, "DisruptionTarget")
    since = parse_rfc3339((disruption or {}).get("lastTransitionTime"))
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    if since is None or grace is None:
        return None
    return since + float(grace)


def kubelet_eviction(pod: Mapping[str, Any]) -> str | None:
    """The kubelet's message when it evicted the pod for node pressure (memory, disk, inodes,
    PIDs) or for a limit of the pod's own (ephemeral-storage, an emptyDir over its
    ``sizeLimit``): pod status reason ``Evicted``, or a DisruptionTarget condition
    ``TerminationByKubelet`` whose message says so. None for anything else, a graceful node
    shutdown included (the same condition reason, status reason ``Terminated``, a message about
    the node's shutdown)."""
    status = pod.get("status") or {}
    disruption = _pod_condition(pod, "DisruptionTarget") or {}
    text = status.get("message") or disruption.get("message") or ""
    if status.get("reason") == "Evicted":
        return text or "evicted by the kubelet"
    if disruption.get("reason") != "TerminationByKubelet":
        return None
    lowered = " ".join(filter(None, (status.get("message"), disruption.get("message")))).lower()
    if "shutdown" in lowered or "shutting down" in lowered:
        return None
    if any(word in lowered for word in _EVICTION_WORDS):
        return text
    return None


def attempt_started(pods: Iterable[Mapping[str, Any]], expected: int) -> bool:
    """Whether all ``expected`` pods of an attempt run at once (phase Running, not being
    deleted, Ready where the kubelet reports it): only then has the attempt started. An
    attempt some of whose pods ran while another stayed unschedulable never started: Kueue's
    PodsReadyTimeout eviction of it is a start failure (backoff, maxRestarts), not a
    preemption to requeue at once forever."""
    ready: set[Any] = set()
    for pod in pods:
        meta = pod.get("metadata") or {}
        if (pod.get("status") or {}).get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        condition = next(
            (c for c in _conditions(pod) if c.get("type") == "Ready"),
            None,
        )
        if condition is not None and condition.get("status") != "True":
            continue
        index = _index(pod)
        ready.add(index if index is not None else meta.get("name"))
    return expected > 0 and len(ready) >= expected


def workload_deactivated(workload: Mapping[str, Any] | None) -> str | None:
    """Why the attempt's Kueue Workload is inactive when someone other than the operator made
    it so (an administrator's ``spec.active: false``, or Kueue at its requeuing limit), else
    None. The operator's own deactivation after an eviction carries
    DEACTIVATED_BY_OPERATOR_ANNOTATION and is not one."""
    if workload is None:
        return None
    meta = workload.get("metadata") or {}
    if DEACTIVATED_BY_OPERATOR_ANNOTATION in (meta.get("annotations") or {}):
        return None
    name = meta.get("name", "")
    evicted = workload_condition(workload, "Evicted")
    if evicted is not None and evicted.get("reason") in DEACTIVATION_EVICTIONS:
        detail = f": {evicted['message']}" if evicted.get("message") else ""
        return f"Kueue Workload {name} was deactivated ({evicted['reason']}){detail}"
    if (workload.get("spec") or {}).get("active") is False:
        return f"Kueue Workload {name} was deactivated (spec.active: false)"
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
    job: Mapping[str, Any] | None,
    workload: Mapping[str, Any] | None,
    was_admitted: bool,
    was_started: bool,
) -> tuple[str, str] | None:
    for ctype in ("Preempted", "Evicted"):
        cond = workload_condition(workload, ctype)
        if cond is not None:
            reason = cond.get("reason") or ctype
            if ctype == "Evicted" and reason in START_FAILURE_EVICTIONS and not was_started:
                # Not a preemption: the pods never all ran together (a bad image or one
                # unschedulable pod under waitForPodsReady, a rejected admission check).
                # Counted as a failure, so maxRestarts and the restart backoff apply instead
                # of an immediate requeue forever.
                return Reason.PODS_NEVER_READY, (
                    f"Kueue evicted the attempt ({reason}) before all its pods ran: "
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


def _kubelet_evicted(pods: Iterable[Mapping[str, Any]]) -> Interruption | None:
    """A pod the kubelet evicted (node pressure, its ephemeral-storage or emptyDir limit): a
    failure, since an attempt that fills its emptyDir would otherwise be evicted and requeued
    forever. Its SIGKILL (grace 0) never raises the grace."""
    for pod in pods:
        message = kubelet_eviction(pod)
        if message is not None:
            name = (pod.get("metadata") or {}).get("name")
            return Interruption(
                "Failed",
                Reason.KUBELET_EVICTED,
                f"pod {name} was evicted by the kubelet: {message.strip()}",
            )
    return None


def _failure(ends: list[ContainerEnd]) -> Interruption | None:
    """The failure that ``ends`` show, naming its root cause first: an OOM kill, then a rank
    that failed on its own, then the ranks killed while they waited for it, last those that
    exited because another rank was gone."""
    failed = [e for e in ends if e.exit_code not in (0, None)]
    failed.sort(key=lambda e: (not e.oom, not e.real_failure, e.peer_failed))
    if not failed:
        return None
    first = failed[0]
    if first.oom:
        return Interruption(
            "Failed",
            Reason.OOM_KILLED,
            f"pod {first.pod} was OOMKilled (exit {first.exit_code}): raise "
            "resourcesPerNode.limits.memory or lower the batch size",
        )
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


def _real_crash(ends: list[ContainerEnd]) -> Interruption | None:
    """The failure when a rank failed on its own (an OOM kill, a non-zero exit that is not a
    preemption, a kill or a peer's end), else None."""
    if not any(e.real_failure for e in ends):
        return None
    return _failure(ends)


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
    was_started: bool = False,
    user_suspended: bool = False,
) -> Interruption:
    """Tell apart success, the kinds of preemption and a real failure.

    ``was_admitted``: Kueue had admitted the attempt (it had pods), so a suspended Job means
    Kueue took it back. ``was_started``: all its pods had run together (attempt_started), so a
    PodsReadyTimeout eviction is a preemption, not a start failure. ``user_suspended``: the
    user asked to suspend.
    Precedence: success; a Workload deactivated by someone else (suspends the TrainingJob);
    the user's suspension; Kueue eviction; the runtime's deadline_too_short exit; a
    kubelet eviction (a failure); a pod disruption condition; node loss, unless a pod's exit
    shows a real crash; the runtime's preemption exit code; otherwise a real crash, a
    container its node lost (ContainerStatusUnknown: node loss), a non-zero exit or a failed
    Job is a failure.
    """
    ends = [e for e in (container_end(p) for p in pods) if e is not None]
    if job_condition(job, "Complete") is not None or (
        ends
        and job is not None
        and len(ends) >= int((job.get("spec") or {}).get("completions") or 1)
        and all(e.exit_code == 0 for e in ends)
    ):
        return Interruption("Succeeded", Reason.COMPLETED, "all ranks finished training")
    deactivated = workload_deactivated(workload)
    if deactivated is not None:
        # Respected, never undone: a fresh Workload would re-admit what an administrator (or
        # Kueue's requeuing limit) stopped, and reset Kueue's requeue count. Before the user's
        # suspension: the operator answers this by setting spec.suspend, and the attempt is
        # recorded with this reason all the same.
        return Interruption(
            "Suspended",
            Reason.WORKLOAD_DEACTIVATED,
            f"{deactivated}; the TrainingJob is suspended (spec.suspend: true): set "
            "spec.suspend to false to resume with a new Workload",
        )
    if user_suspended:
        return Interruption("Suspended", Reason.SUSPENDED, "suspended by the user (spec.suspend)")
    kueue = _kueue_eviction(job, workload, was_admitted, was_started)
    if kueue is not None:
        outcome: Outcome = "Failed" if kueue[0] == Reason.PODS_NEVER_READY else "Preempted"
        return Interruption(outcome, *kueue)
    # After Kueue's eviction (whose Workload the operator must deactivate), before the node's
    # reasons: on a spot reclaim the node's notice is what the save did not fit.
    too_short = deadline_too_short(ends)
    if too_short is not None:
        return too_short
    evicted = _kubelet_evicted(pods)
    if evicted is not None:
        return evicted
    disruption = _disruption(pods)
    if disruption is not None:
        return Interruption("Preempted", *disruption)
    crash = _real_crash(ends)
    lost = _node_lost(pods, node_ready)
    if lost is not None and crash is None:
        # A real crash reported by a kubelet wins over a NotReady node: a node's heartbeat may
        # lapse for a while around the crash, and the crash must count against maxRestarts.
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
    if crash is not None:
        return crash
    unknown = [e for e in ends if e.status_unknown]
    if unknown:
        # After a node reboot the kubelet reports the container it no longer finds as
        # ContainerStatusUnknown with exit 137: the node lost the attempt (a preemption, never
        # a grace to double).
        first = unknown[0]
        return Interruption(
            "Preempted",
            Reason.NODE_LOST,
            f"pod {first.pod}: its node lost the container ({CONTAINER_STATUS_UNKNOWN}, exit "
            f"{first.exit_code}; e.g. the node rebooted)"
            + (f": {first.raw_message.strip()[-200:]}" if first.raw_message else ""),
        )
    failure = _failure(ends)
    if failure is not None:
        return failure
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
