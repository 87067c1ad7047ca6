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
from preemptible_operator.classify import Interruption
from preemptible_operator.conditions import Reason
from preemptible_operator.phases import Decision
from preemptible_operator.timestamps import parse_rfc3339
from preemptible_operator.workload import ANNOTATION_SLICE, Admission, eviction
from trainer_runtime.elastic import restart_pays, sizes_keeping_global_batch

__all__ = [
    "UNMEASURED_START_SECONDS",
    "ElasticGate",
    "Grow",
    "Slices",
    "admitted_flavors",
    "attempt_size",
    "elastic_sizes",
    "gated_decision",
    "grow_plan",
    "nodes_shown",
    "replaced",
    "reservation_held",
    "resize_interruption",
    "size_event",
    "slice_of",
    "slices",
    "start_gate",
    "workload_finished",
]

UNMEASURED_START_SECONDS = 120.0
"""Pod start and resume assumed when the status has not measured them (conservative: a grow is
planned only when even this pause pays)."""

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


def gated_decision(decision: Decision, gate: ElasticGate) -> Decision:
    """An elastic job's create, held by its Workload: no attempt Job before Kueue admits a size
    that keeps the global batch (the job shows Queued with the gate's reason)."""
    if decision.action != "create_attempt" or gate.action == "start":
        return decision
    return Decision("Queued", "none", Reason.QUEUED, gate.message)


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


def slice_of(workload: Mapping[str, Any]) -> int:
    """Which slice of its TrainingJob a Workload is (1 first, one more per grow)."""
    raw = ((workload.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_SLICE, "1")
    return int(raw) if str(raw).isdigit() else 1


@dataclass(frozen=True)
class Slices:
    """An elastic TrainingJob's Workloads as one pass sees them."""

    current: dict[str, Any] | None
    """The one the current attempt runs under (the attempt Job's slice annotation), else the
    newest that is not finished, else the newest."""
    pending: tuple[dict[str, Any], ...]
    """Newer slices than ``current`` not finished: a grow asked for."""
    others: tuple[dict[str, Any], ...]
    """Every other slice, finished or older."""


def slices(workloads: list[dict[str, Any]], attempt_slice: int | None) -> Slices:
    """Sort the TrainingJob's Workloads (``attempt_slice``: the running attempt's, None when no
    attempt runs)."""
    ordered = sorted(workloads, key=slice_of)
    current = None
    if attempt_slice is not None:
        current = next((w for w in ordered if slice_of(w) == attempt_slice), None)
    if current is None:
        live = [w for w in ordered if not workload_finished(w)]
        current = live[-1] if live else (ordered[-1] if ordered else None)
    if current is None:
        return Slices(None, (), ())
    pending = tuple(
        w for w in ordered if slice_of(w) > slice_of(current) and not workload_finished(w)
    )
    others = tuple(w for w in ordered if w is not current and w not in pending)
    return Slices(current, pending, others)


def replaced(workload: Mapping[str, Any]) -> bool:
    """Kueue finished the Workload because a replacement slice was admitted (a grow)."""
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Finished" and cond.get("status") == "True":
            return cond.get("reason") == "WorkloadSliceReplaced"
    return False


def resize_interruption(
    workload: Mapping[str, Any] | None, interruption: Interruption, nodes: int | None
) -> Interruption | None:
    """An elastic attempt whose Workload Kueue replaced by a bigger slice: it stops at a
    checkpoint (a JIT stop) and the next attempt starts at the new size. Recorded like a
    suspension (outcome Suspended): neither a preemption nor a failure. None otherwise."""
    # Like a suspension: the operator's own stop wins over what the stopped pods show (a kill
    # at the grace deadline), except a training that finished first.
    if workload is None or interruption.outcome == "Succeeded" or not replaced(workload):
        return None
    name = (workload.get("metadata") or {}).get("name")
    return Interruption(
        "Suspended",
        Reason.RESIZING,
        f"Kueue admitted a bigger slice replacing Workload {name}: stopping the attempt on "
        f"{nodes or '?'} pod(s) at a checkpoint to restart at the new size",
    )


@dataclass(frozen=True)
class Grow:
    """A grow worth asking Kueue for now."""

    target: int
    pause_seconds: float
    message: str


def _same_size_since(attempts: list[models.AttemptRecord], nodes: int) -> float | None:
    """When the attempts ending with the current one started running at ``nodes`` pods."""
    since = None
    for record in reversed(attempts):
        if record.nodes != nodes:
            break
        at = parse_rfc3339(record.running_time)
        if at is None:
            break
        since = at
    return since


def grow_plan(
    spec: models.TrainingJobSpec,
    status: models.TrainingJobStatus,
    record: models.AttemptRecord | None,
    now: float,
) -> Grow | None:
    """Whether to ask Kueue for more pods now (a replacement slice): the attempt runs (all its
    pods started) below the largest size, its size is older than growCooldownSeconds, and the
    restart pays within the cooldown (restart_pays) with the pause measured: the JIT save
    (saveSecondsMax, else the attempt's grace), the pods' start and the resume (the attempt's
    creation to all pods running, counted twice; UNMEASURED_START_SECONDS when unknown)."""
    elastic = spec.elastic
    if elastic is None or record is None or record.nodes is None or record.end_time:
        return None
    started = parse_rfc3339(record.running_time)
    if started is None:
        return None
    sizes = elastic_sizes(spec)
    bigger = [s for s in sizes if s > record.nodes]
    if not bigger:
        return None
    since = _same_size_since(list(status.attempts or []), record.nodes) or started
    cooldown = float(elastic.grow_cooldown_seconds)
    if now - since < cooldown:
        return None
    timings = status.timings
    save = None
    if timings is not None:
        save = timings.save_seconds_max or timings.save_seconds_last
    if save is None:
        save = float(record.grace_seconds or spec.grace_period.initial_seconds)
    created = parse_rfc3339(record.start_time)
    start = started - created if created is not None else UNMEASURED_START_SECONDS
    pause = save + 2 * max(0.0, start)
    # The next size up is the least a replacement asks for (its minCount).
    target = bigger[0]
    if not restart_pays(record.nodes, target, cooldown, pause):
        return None
    return Grow(
        target,
        pause,
        f"asking Kueue for {target}-{sizes[-1]} pods (running on {record.nodes}): a restart "
        f"of about {pause:.0f} s (save {save:.0f} s, start and resume {2 * start:.0f} s) pays "
        f"within growCooldownSeconds ({cooldown:.0f} s)",
    )
