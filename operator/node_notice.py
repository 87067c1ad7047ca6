"""How much notice a node gives before it goes away, from what its Node object tells us (pure,
table-tested).

A spot (preemptible) node is reclaimed after a fixed notice whatever grace period a pod asks
for; the runtime must count its deadline from SIGTERM plus that notice when it is the shorter, so
that a save that cannot fit is not started (DeadlineTooShort) instead of being killed half-way.

What is visible on a Node, and therefore used here:

- an explicit ``preemptible.dev/node-notice-seconds`` annotation (or label) on the Node, set by
  the cluster's administrator: it wins over the table below (a GKE node pool whose graceful
  termination was extended to 120 s, an on-premises kubelet's ``shutdownGracePeriod``);
- the capacity-type labels the major clouds put on spot nodes, with their documented notices
  (:data:`SPOT_LABELS`).

What is NOT visible: the kubelet's graceful node shutdown settings (``shutdownGracePeriod``,
``shutdownGracePeriodCriticalPods``) are kubelet configuration, not Node fields, and a shutdown
in progress shows only as ``Ready=False`` ("node is shutting down") after the pods already got
their SIGTERM. Such nodes need the annotation (or ``spec.gracePeriod.nodeNoticeSeconds``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ANNOTATION_NODE_NOTICE",
    "EC2_DRAIN_LEAD",
    "SPOT_LABELS",
    "NodeNotice",
    "node_notice",
    "pod_notice_patch",
]

# On a Node (set by an administrator): the notice its pods get, in seconds. On a pod (written by
# the operator once the pod is bound): its node's inferred notice, which the runtime reads at
# SIGTERM through a downward-API volume (render.NODE_NOTICE_VOLUME).
ANNOTATION_NODE_NOTICE = "preemptible.dev/node-notice-seconds"


@dataclass(frozen=True)
class SpotLabel:
    """A label a cloud puts on its spot nodes, and the notice those nodes give user pods."""

    key: str
    values: frozenset[str]
    notice: int
    """The cloud's notice, counted from its own warning."""
    why: str
    lead: int = 0
    """Seconds assumed between that warning and the pod's SIGTERM (the runtime counts its
    deadline from SIGTERM): 0 where the kubelet itself is warned (graceful node shutdown)."""

    @property
    def seconds(self) -> int:
        """The notice counted from the pod's SIGTERM."""
        return self.notice - self.lead


EC2_DRAIN_LEAD = 30
"""Seconds of EC2's 120 s Spot notice assumed gone before a pod's SIGTERM (the handler's
detection and drain; a node annotation preemptible.dev/node-notice-seconds overrides it where a
cluster measured its own)."""

SPOT_LABELS: tuple[SpotLabel, ...] = (
    # GKE: 30 s from the preemption notice to the VM's end, split by graceful node shutdown into
    # 15 s for ordinary pods and 15 s for system-critical ones (the default; a node pool may
    # extend it: annotate such nodes).
    SpotLabel("cloud.google.com/gke-spot", frozenset({"true"}), 15, "GKE Spot VM"),
    SpotLabel("cloud.google.com/gke-preemptible", frozenset({"true"}), 15, "GKE preemptible VM"),
    # EC2: the Spot interruption warning comes two minutes before the instance is reclaimed,
    # but the pods get SIGTERM only once a handler (Karpenter, the node termination handler, an
    # EKS managed node group) has received the warning (an SQS queue or metadata polling) and
    # drained the node to them: the 120 s are not counted from SIGTERM. EC2_DRAIN_LEAD of them
    # are assumed spent before it.
    SpotLabel(
        "eks.amazonaws.com/capacityType",
        frozenset({"SPOT"}),
        120,
        "EKS managed Spot",
        lead=EC2_DRAIN_LEAD,
    ),
    SpotLabel(
        "karpenter.sh/capacity-type",
        frozenset({"spot"}),
        120,
        "Karpenter Spot",
        lead=EC2_DRAIN_LEAD,
    ),
    # Azure: a Spot VM's eviction (a Preempt scheduled event) comes at least 30 s ahead.
    SpotLabel("kubernetes.azure.com/scalesetpriority", frozenset({"spot"}), 30, "AKS Spot"),
)


@dataclass(frozen=True)
class NodeNotice:
    """A node's notice and what said so (the label or annotation), for logs and events."""

    seconds: int
    source: str


def _explicit(meta: Mapping[str, Any]) -> NodeNotice | None:
    for kind in ("annotations", "labels"):
        raw = (meta.get(kind) or {}).get(ANNOTATION_NODE_NOTICE)
        if raw is None:
            continue
        try:
            seconds = int(str(raw).strip())
        except ValueError:
            continue  # not a number: ignored, as if unset (the table still applies)
        if seconds >= 1:
            return NodeNotice(seconds, f"{kind[:-1]} {ANNOTATION_NODE_NOTICE}")
    return None


def node_notice(node: Mapping[str, Any] | None) -> NodeNotice | None:
    """The notice ``node`` gives its pods before it goes away; None when nothing says.

    An explicit annotation (then label) :data:`ANNOTATION_NODE_NOTICE` wins; otherwise the
    shortest notice among the spot labels the node carries.
    """
    if not node:
        return None
    meta = node.get("metadata") or {}
    explicit = _explicit(meta)
    if explicit is not None:
        return explicit
    labels = meta.get("labels") or {}
    found = [
        NodeNotice(
            spot.seconds,
            f"label {spot.key}={labels[spot.key]} ({spot.why}"
            + (f": {spot.notice} s from its warning, {spot.lead} s assumed before SIGTERM)"
               if spot.lead else ")"),
        )
        for spot in SPOT_LABELS
        if labels.get(spot.key) in spot.values
    ]  # fmt: skip
    return min(found, key=lambda n: n.seconds) if found else None


def pod_notice_patch(pod: Mapping[str, Any], notice: NodeNotice | None) -> dict[str, Any] | None:
    """The merge patch that makes ``pod``'s annotation say ``notice`` (None: removes it); None
    when the pod already says so, or has ended or is being deleted (its SIGTERM has come: too
    late for the runtime to read a new value)."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in (
        "Succeeded",
        "Failed",
    ):
        return None
    if not (pod.get("spec") or {}).get("nodeName"):
        return None
    have = (meta.get("annotations") or {}).get(ANNOTATION_NODE_NOTICE)
    want = str(notice.seconds) if notice is not None else None
    if have == want:
        return None
    return {"metadata": {"annotations": {ANNOTATION_NODE_NOTICE: want}}}
