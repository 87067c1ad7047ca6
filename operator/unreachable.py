"""When an attempt's pod is stuck on a NotReady node that is never deleted: a pure decision.

The operator never treats such a pod as gone (classify.pod_finished): a partitioned node's kubelet
may still run it and write checkpoints, and the next attempt must not write beside it. Where the
cloud provider deletes dead Nodes this settles itself; on bare metal, or with a kubelet that died
for good, nothing ever deletes the Node and the attempt would sit in Checkpointing silently. Past a
bound the operator says so (condition NodeUnreachable, a Warning Event) and names the two ways out
an administrator has: the ``node.kubernetes.io/out-of-service`` taint or deleting the Node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from preemptible_operator import conditions as cond
from preemptible_operator import models
from preemptible_operator.conditions import Event, Reason
from preemptible_operator.observation import Snapshot
from preemptible_operator.timestamps import parse_rfc3339

__all__ = [
    "OUT_OF_SERVICE_TAINT",
    "StuckNodes",
    "stuck_on_unreachable_nodes",
    "unreachable_condition",
]

OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"


@dataclass(frozen=True)
class StuckNodes:
    """Pods stuck on NotReady nodes past the bound."""

    nodes: tuple[str, ...]
    pods: tuple[str, ...]
    since: float
    """The earliest grace deadline among them (epoch seconds)."""

    def message(self, now: float) -> str:
        nodes = ", ".join(self.nodes)
        first = self.nodes[0]
        return (
            f"pod(s) {', '.join(self.pods)} on NotReady node(s) {nodes} have not ended "
            f"{now - self.since:.0f} s after their grace deadline; the attempt waits for them "
            "(the node may be partitioned and its pods still writing checkpoints). If the node "
            f"is down for good, taint it: kubectl taint nodes {first} "
            f"{OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute (Kubernetes then force-deletes its "
            "pods and detaches their volumes), or delete it: kubectl delete node "
            f"{first}. Either lets the next attempt start from the last complete checkpoint."
        )


def _terminated(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all((s.get("state") or {}).get("terminated") for s in statuses)


def stuck_on_unreachable_nodes(
    pods: Iterable[Mapping[str, Any]],
    node_ready: Mapping[str, bool],
    not_ready_since: Mapping[str, float],
    now: float,
    after_seconds: int,
) -> StuckNodes | None:
    """The pods that still hold the attempt on NotReady nodes more than ``after_seconds`` past
    their grace deadline: the pod's ``deletionTimestamp`` when it was deleted (that is the
    deadline), else the time its node went NotReady plus its terminationGracePeriodSeconds.
    Pods on a Ready node, on a deleted node (absent from ``node_ready``: the pod GC settles
    those), already terminated, or with no known deadline do not count. None when none is."""
    stuck: list[tuple[str, str, float]] = []
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or node not in node_ready or node_ready[node] or _terminated(pod):
            continue
        deadline = parse_rfc3339((pod.get("metadata") or {}).get("deletionTimestamp"))
        if deadline is None and node in not_ready_since:
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 0
            deadline = not_ready_since[node] + float(grace)
        if deadline is None or now - deadline < after_seconds:
            continue
        stuck.append((node, (pod.get("metadata") or {}).get("name", ""), deadline))
    if not stuck:
        return None
    return StuckNodes(
        nodes=tuple(sorted({n for n, _, _ in stuck})),
        pods=tuple(sorted(p for _, p, _ in stuck)),
        since=min(d for _, _, d in stuck),
    )


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
