"""Pure building blocks of an elastic TrainingJob's Kueue Workload (docs/elastic.md, option 3).

The operator creates one Workload per elastic TrainingJob and plays Kueue's job-integration part
for it: it reads the admission (how many pods, on which flavors), clears the reservation once an
evicted attempt has stopped (which requeues the same Workload, keeping its place in the queue),
finishes it at the end, and grows through a replacement slice. Every write here is what Kueue
v0.19.2 accepted on the cluster tier (tests/operator/test_kueue_workload_protocol.py builds its
Workloads and patches with these functions). No API calls: inputs and outputs are plain dicts in
the apiserver's JSON shape (camelCase).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from preemptible_operator import models, render

__all__ = [
    "ANNOTATION_REPLACEMENT_FOR",
    "ANNOTATION_SLICE",
    "KUEUE_API",
    "KUEUE_GROUP",
    "KUEUE_VERSION",
    "MAX_WORKLOAD_NAME_LENGTH",
    "MERGE_PATCH",
    "POD_SET_NAME",
    "WORKLOAD_PLURAL",
    "Admission",
    "Eviction",
    "admitted_size",
    "clear_reservation_patch",
    "eviction",
    "finished_patch",
    "render_replacement",
    "render_workload",
    "workload_name",
]

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"
KUEUE_API = f"{KUEUE_GROUP}/{KUEUE_VERSION}"
WORKLOAD_PLURAL = "workloads"
# The status writes are JSON merge patches of the status subresource: the content type to send.
MERGE_PATCH = "application/merge-patch+json"
POD_SET_NAME = "workers"
# Read by Kueue's scheduler on the Workload itself (workloadslicing.ReplacedWorkloadSlice). Not
# kueue.x-k8s.io/elastic-job: Kueue's webhook refuses minCount on a Workload carrying that one.
ANNOTATION_REPLACEMENT_FOR = "kueue.x-k8s.io/workload-slice-replacement-for"
# Which slice of the job a Workload is (1, then one more per grow): names the next one.
ANNOTATION_SLICE = "preemptible.dev/workload-slice"
# A DNS label: Kueue copies Workload names into label values in places (63 at most).
MAX_WORKLOAD_NAME_LENGTH = 63
# Kueue truncates condition messages to this (api.TruncateConditionMessage); the apiserver
# refuses longer ones.
_MAX_MESSAGE = 32768


@dataclass(frozen=True)
class Admission:
    """What Kueue admitted, as the attempt Job must apply it."""

    count: int
    """Pods admitted (the attempt's node count before the global-batch rule rounds it down)."""
    node_selector: dict[str, str]
    """The assigned flavors' ``nodeLabels``, merged (Kueue's podset.FromAssignment)."""
    tolerations: list[dict[str, Any]]
    """The assigned flavors' ``tolerations``, without duplicates."""
    flavors: tuple[str, ...]
    """The assigned ResourceFlavors, sorted."""


@dataclass(frozen=True)
class Eviction:
    """Why Kueue evicted the Workload (its ``Evicted`` condition)."""

    reason: str
    message: str


def workload_name(name: str, slice_index: int = 1) -> str:
    """Deterministic name of slice ``slice_index`` of TrainingJob ``name``'s Workload: a second
    create of the same slice is a conflict, never a duplicate. ``<name>-w<slice>``, cut with a
    hash of the full name past 63 characters (names the apiserver admits always fit)."""
    if slice_index < 1:
        raise ValueError(f"slice_index must be >= 1, got {slice_index}")
    full = f"{name}-w{slice_index}"
    if len(full) <= MAX_WORKLOAD_NAME_LENGTH:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:8]
    suffix = f"-{digest}-w{slice_index}"
    return f"{name[: MAX_WORKLOAD_NAME_LENGTH - len(suffix)].rstrip('-')}{suffix}"


def _check_sizes(min_nodes: int, max_nodes: int) -> None:
    if min_nodes < 1 or max_nodes < min_nodes:
        raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes} and {max_nodes}")


def _pod_set(template: dict[str, Any], count: int, min_count: int | None) -> dict[str, Any]:
    pod_set: dict[str, Any] = {"name": POD_SET_NAME, "count": count, "template": template}
    # minCount == count is no partial admission: leave it out (Kueue reads its presence).
    if min_count is not None and min_count < count:
        pod_set["minCount"] = min_count
    return pod_set


def render_workload(
    meta: dict[str, Any],
    spec: models.TrainingJobSpec,
    params: render.AttemptParams,
    *,
    min_nodes: int,
    max_nodes: int,
    priority: int | None = None,
    slice_index: int = 1,
) -> dict[str, Any]:
    """The Workload of an elastic TrainingJob: one pod set of the attempt Job's pod template
    (render.render_pod_template for ``params``), ``count: max_nodes``, ``minCount: min_nodes``.

    ``priority`` is the value of ``spec.priorityClass`` (a WorkloadPriorityClass): Kueue's webhook
    does not fill it in, and the CRD refuses ``priorityClassRef`` without it.
    """
    _check_sizes(min_nodes, max_nodes)
    if not spec.queue_name:
        raise ValueError("spec.queueName is required: a Workload without a queue is never admitted")
    if spec.priority_class and priority is None:
        raise ValueError(f"priority: the value of class {spec.priority_class!r} is required")
    if priority is not None and not spec.priority_class:
        raise ValueError("priority given without spec.priorityClass")
    name = meta["name"]
    labels, annotations = render.propagated_metadata(meta)
    workload_spec: dict[str, Any] = {"queueName": spec.queue_name}
    if spec.priority_class:
        workload_spec["priorityClassRef"] = {
            "group": KUEUE_GROUP,
            "kind": "WorkloadPriorityClass",
            "name": spec.priority_class,
        }
        workload_spec["priority"] = priority
    # Kueue reads the template's requests, node selector, affinity and tolerations; the rest
    # (attempt-specific env and annotations of ``params``) is kept as the record of what runs.
    template = render.render_pod_template(meta, spec, params)
    workload_spec["podSets"] = [_pod_set(template, max_nodes, min_nodes)]
    return {
        "apiVersion": KUEUE_API,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(name, slice_index),
            "namespace": meta["namespace"],
            "labels": {**labels, render.LABEL_TRAINING_JOB: name},
            "annotations": {
                **annotations,
                ANNOTATION_SLICE: str(slice_index),
                **({render.ANNOTATION_TJ_UID: meta["uid"]} if meta.get("uid") else {}),
            },
            "ownerReferences": [render.owner_reference(meta)],
        },
        "spec": workload_spec,
    }


def render_replacement(
    old: dict[str, Any],
    *,
    current_nodes: int,
    max_nodes: int,
    sizes: Iterable[int] | None = None,
) -> dict[str, Any]:
    """The grow: a new slice replacing ``old`` (admitted at ``current_nodes``), ``count:
    max_nodes`` and ``minCount`` the smallest size above ``current_nodes`` (of ``sizes``, the
    sizes that keep the global batch, when given).

    While it is pending the old slice keeps its nodes (Kueue counts them for the replacement);
    once it is admitted Kueue finishes the old one (``WorkloadSliceReplaced``). Partial, so that
    one grow (one restart) reaches the largest size that fits rather than one size per grow; the
    risk (docs/elastic.md) concerns only a replacement that must preempt to fit.
    """
    bigger = sorted(s for s in (sizes if sizes is not None else [current_nodes + 1]) if s > 0)
    bigger = [s for s in bigger if current_nodes < s <= max_nodes]
    if not bigger:
        raise ValueError(f"no size in ({current_nodes}, {max_nodes}] to grow to")
    meta = old["metadata"]
    annotations = dict(meta.get("annotations") or {})
    slice_index = int(annotations.get(ANNOTATION_SLICE, "1")) + 1
    annotations[ANNOTATION_SLICE] = str(slice_index)
    annotations[ANNOTATION_REPLACEMENT_FOR] = f"{meta['namespace']}/{meta['name']}"
    tj_name = (meta.get("labels") or {}).get(render.LABEL_TRAINING_JOB)
    if not tj_name:
        raise ValueError(f"Workload {meta['name']} has no {render.LABEL_TRAINING_JOB} label")
    spec = copy.deepcopy(old["spec"])
    # Kueue's defaults and status-derived fields stay behind; the pod set is the old one resized.
    spec.pop("active", None)
    (old_pod_set,) = spec["podSets"]
    spec["podSets"] = [_pod_set(old_pod_set["template"], max_nodes, bigger[0])]
    return {
        "apiVersion": old.get("apiVersion", KUEUE_API),
        "kind": "Workload",
        "metadata": {
            "name": workload_name(tj_name, slice_index),
            "namespace": meta["namespace"],
            "labels": dict(meta.get("labels") or {}),
            "annotations": annotations,
            "ownerReferences": copy.deepcopy(meta["ownerReferences"]),
        },
        "spec": spec,
    }


def _condition(workload: Mapping[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None


def _is_true(workload: Mapping[str, Any], kind: str) -> bool:
    cond = _condition(workload, kind)
    return cond is not None and cond.get("status") == "True"


def _set_conditions(
    workload: Mapping[str, Any], changes: dict[str, dict[str, str]], now: str
) -> list[dict[str, Any]]:
    """The whole conditions list with ``changes`` applied as apimeta.SetStatusCondition does:
    the transition time moves only when the status changes; reason, message and
    observedGeneration are always the new ones. A merge patch replaces lists, so it is sent
    whole."""
    generation = workload["metadata"].get("generation", 1)
    pending = {
        kind: {**change, "message": change["message"][:_MAX_MESSAGE]}
        for kind, change in changes.items()
    }
    conditions: list[dict[str, Any]] = []
    for cond in (workload.get("status") or {}).get("conditions") or []:
        new = pending.pop(cond["type"], None)
        if new is None:
            conditions.append(copy.deepcopy(cond))
            continue
        moved = new["status"] != cond.get("status")
        conditions.append(
            {
                **cond,
                **new,
                "observedGeneration": generation,
                "lastTransitionTime": now if moved else cond.get("lastTransitionTime", now),
            }
        )
    for kind, new in pending.items():
        conditions.append(
            {"type": kind, **new, "lastTransitionTime": now, "observedGeneration": generation}
        )
    return conditions


def clear_reservation_patch(workload: Mapping[str, Any], now: str) -> dict[str, Any]:
    """The owner's write once an evicted Workload's attempt has stopped: what Kueue's job
    reconciler writes for an integration (jobframework: SetRequeuedCondition +
    UnsetQuotaReservationWithCondition), as a JSON merge patch (``MERGE_PATCH``) of the status
    subresource. ``admission`` is dropped; ``QuotaReserved`` False (``Pending``), ``Admitted``
    False (``NoReservation``), ``Requeued`` True with the eviction's reason; ``Evicted`` and
    ``Preempted`` stay (Kueue resets them on the next reservation). Conditional on the read
    ``resourceVersion``: a 409 means Kueue wrote meanwhile, so re-read and build it again.
    ``now`` is an RFC 3339 time (``2026-01-01T00:00:00Z``)."""
    evicted = eviction(workload)
    if evicted is None:
        raise ValueError(f"Workload {workload['metadata']['name']} is not evicted")
    conditions = _set_conditions(
        workload,
        {
            "QuotaReserved": {"status": "False", "reason": "Pending", "message": evicted.message},
            "Admitted": {
                "status": "False",
                "reason": "NoReservation",
                "message": "The workload has no reservation",
            },
            "Requeued": {"status": "True", "reason": evicted.reason, "message": evicted.message},
        },
        now,
    )
    return {
        "metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
        "status": {"admission": None, "conditions": conditions},
    }


def finished_patch(
    workload: Mapping[str, Any], now: str, *, succeeded: bool, message: str
) -> dict[str, Any]:
    """The owner's write when the training ends: ``Finished`` True, reason ``Succeeded`` or
    ``Failed`` (Kueue's finish.Finish). Kueue then releases the quota; the admission stays as a
    record. A merge patch of the status subresource, conditional like
    :func:`clear_reservation_patch`."""
    reason = "Succeeded" if succeeded else "Failed"
    conditions = _set_conditions(
        workload, {"Finished": {"status": "True", "reason": reason, "message": message}}, now
    )
    return {
        "metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]},
        "status": {"conditions": conditions},
    }


def eviction(workload: Mapping[str, Any]) -> Eviction | None:
    """The eviction Kueue asks for (``Evicted`` True), or None."""
    cond = _condition(workload, "Evicted")
    if cond is None or cond.get("status") != "True":
        return None
    return Eviction(reason=cond.get("reason", ""), message=cond.get("message", ""))


def admitted_size(
    workload: Mapping[str, Any], flavors: Mapping[str, Mapping[str, Any]]
) -> Admission | None:
    """The admission an attempt may run with now, or None: not admitted (``QuotaReserved`` and
    ``Admitted`` both True, ``status.admission`` set), or evicted or finished (no new attempt on
    those; see :func:`eviction`).

    ``flavors``: the ResourceFlavors by name, as the API returns them; the assigned ones' node
    labels and tolerations are what the attempt's pods must carry (Kueue's podset.FromAssignment
    for its own integrations). A flavor missing from it is an error (Kueue fails the same way).
    """
    if not (_is_true(workload, "QuotaReserved") and _is_true(workload, "Admitted")):
        return None
    if eviction(workload) is not None or _is_true(workload, "Finished"):
        return None
    admission = (workload.get("status") or {}).get("admission") or {}
    assignments = admission.get("podSetAssignments") or []
    if not assignments:
        return None
    assignment = assignments[0]
    count = assignment.get("count")
    if count is None:  # Kueue leaves it out when the whole pod set is admitted
        count = workload["spec"]["podSets"][0].get("count", 1)
    names = sorted(set((assignment.get("flavors") or {}).values()))
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    for name in names:
        if name not in flavors:
            raise KeyError(f"ResourceFlavor {name!r} of the admission is unknown")
        flavor_spec = flavors[name].get("spec") or {}
        node_selector.update(flavor_spec.get("nodeLabels") or {})
        for toleration in flavor_spec.get("tolerations") or []:
            if toleration not in tolerations:
                tolerations.append(copy.deepcopy(toleration))
    return Admission(
        count=int(count),
        node_selector=node_selector,
        tolerations=tolerations,
        flavors=tuple(names),
    )
