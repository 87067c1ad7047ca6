"""The elastic attempt's decisions (pure): for a TrainingJob with ``spec.elastic`` the operator
keeps one Kueue Workload per TrainingJob (operator/workload.py) and starts each attempt with the
size its admission allows (docs/elastic.md, option 3). Which step the create path takes now
(``start_gate``), the sizes that keep the global batch, the size an admission gives, the Event
of a size change and the status's NODES column (tests/unit/operator/test_elastic_attempt.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from preemptible_operator import models
from preemptible_operator.conditions import Reason
from preemptible_operator.workload import Admission, eviction
from trainer_runtime.elastic import sizes_keeping_global_batch

__all__ = [
    "ElasticGate",
    "admitted_flavors",
    "attempt_size",
    "elastic_sizes",
    "nodes_shown",
    "reservation_held",
    "size_event",
    "start_gate",
    "workload_finished",
]

GateAction = Literal["create_workload", "clear_reservation", "wait", "start"]


@dataclass(frozen=True)
class ElasticGate:
    """What the create path of an elastic job does in this pass."""

    action: GateAction
    """create_workload: the TrainingJob's Workload does not exist yet; clear_reservation: it is
    evicted and its previous attempt is gone (the owner's requeue write); wait: not admitted
    (yet); start: create the attempt Job with ``nodes`` pods."""
    message: str
    nodes: int | None = None
    """Pods of the attempt to start (``start`` only)."""
    unused: int = 0
    """Admitted pods the attempt cannot use (no size between it and the admitted count keeps
    the global batch): reserved for nothing until the next attempt."""


def elastic_sizes(spec: models.TrainingJobSpec) -> tuple[int, ...]:
    """The sizes in [minNodes, maxNodes] (maxNodes defaults to numNodes) that keep the global
    batch of numNodes pods accumulating gradientAccumulationSteps; (numNodes,) without
    spec.elastic. The apiserver refuses a range without any (spec_rules)."""
    elastic = spec.elastic
    if elastic is None:
        return (spec.num_nodes,)
    return sizes_keeping_global_batch(
        spec.num_nodes,
        elastic.gradient_accumulation_steps,
        elastic.min_nodes,
        elastic.max_nodes if elastic.max_nodes is not None else spec.num_nodes,
    )


def attempt_size(admitted: int, sizes: tuple[int, ...]) -> int | None:
    """The largest size that keeps the global batch and fits the admitted pod count."""
    fitting = [s for s in sizes if s <= admitted]
    return max(fitting) if fitting else None


def _condition_true(workload: Mapping[str, Any], kind: str) -> bool:
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond.get("status") == "True"
    return False


def reservation_held(workload: Mapping[str, Any]) -> bool:
    """Whether Kueue still holds quota for the Workload (QuotaReserved True)."""
    return _condition_true(workload, "QuotaReserved")


def workload_finished(workload: Mapping[str, Any]) -> bool:
    """Whether the Workload is Finished (by the operator at the end, or by Kueue when a
    replacement slice took over)."""
    return _condition_true(workload, "Finished")


def admitted_flavors(workload: Mapping[str, Any]) -> tuple[str, ...]:
    """The ResourceFlavors the Workload's admission names (to read before ``admitted_size``)."""
    admission = (workload.get("status") or {}).get("admission") or {}
    names = {
        flavor
        for assignment in admission.get("podSetAssignments") or []
        for flavor in (assignment.get("flavors") or {}).values()
    }
    return tuple(sorted(names))


def start_gate(
    workload: Mapping[str, Any] | None,
    admission: Admission | None,
    sizes: tuple[int, ...],
    workload_name: str,
) -> ElasticGate:
    """The create path of an elastic job's next attempt: the previous attempt's pods are all
    gone when this is asked (next_phase waits for them), so an evicted Workload that still
    holds its reservation is released now, which requeues the same Workload."""
    if workload is None:
        return ElasticGate("create_workload", f"creating Kueue Workload {workload_name}")
    if workload_finished(workload):
        return ElasticGate("wait", f"Kueue Workload {workload_name} is finished")
    evicted = eviction(workload)
    if evicted is not None:
        if reservation_held(workload):
            return ElasticGate(
                "clear_reservation",
                f"Kueue evicted Workload {workload_name} ({evicted.reason}); the attempt has "
                "stopped: releasing its reservation, the same Workload requeues",
            )
        return ElasticGate("wait", f"waiting for Kueue to admit Workload {workload_name} again")
    if admission is None:
        return ElasticGate("wait", f"waiting for Kueue admission of Workload {workload_name}")
    nodes = attempt_size(admission.count, sizes)
    if nodes is None:  # minCount is the smallest size: Kueue never admits fewer
        return ElasticGate(
            "wait",
            f"Kueue admitted {admission.count} pod(s) of Workload {workload_name}, fewer than "
            f"any size that keeps the global batch ({', '.join(map(str, sizes))})",
        )
    message = f"Kueue admitted {admission.count} pod(s) of Workload {workload_name}"
    return ElasticGate("start", message, nodes=nodes, unused=admission.count - nodes)


def size_event(
    previous: int | None,
    nodes: int,
    spec: models.TrainingJobSpec,
    admitted: int,
    sizes: tuple[int, ...],
) -> tuple[str, str, str] | None:
    """The Event (type, reason, message) of an attempt starting on another size than the one
    before it (``previous``; spec.numNodes for the first): ScaledDown or ScaledUp, with why."""
    before = previous if previous is not None else spec.num_nodes
    if nodes == before:
        return None
    reason = Reason.SCALED_DOWN if nodes < before else Reason.SCALED_UP
    accumulation = spec.elastic.gradient_accumulation_steps if spec.elastic else 1
    per = spec.num_nodes * accumulation // nodes
    return (
        "Normal",
        reason,
        f"{before} -> {nodes} pod(s): Kueue admitted {admitted}, the sizes that keep the global "
        f"batch of {spec.num_nodes} pod(s) x {accumulation} accumulation step(s) are "
        f"{', '.join(map(str, sizes))}; the attempt accumulates {per} step(s)",
    )


def nodes_shown(nodes: int | None, spec: models.TrainingJobSpec) -> str | None:
    """status.nodes: the current attempt's pods over the most it may run on ("3/4")."""
    if nodes is None:
        return None
    most = spec.num_nodes
    if spec.elastic is not None and spec.elastic.max_nodes is not None:
        most = spec.elastic.max_nodes
    return f"{nodes}/{most}"
