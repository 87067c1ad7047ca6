"""What the operator's watch caches (kopf indexes) keep of each child: the fields a reconcile pass
reads, not whole objects. A Job's pod template, a pod's containers and a Kueue Workload's pod
sets (each a full pod template) are most of their size, and the caches hold every child of
every TrainingJob (issue 30: 279 MB at 1,500 jobs with whole Workloads cached).

``tests/unit/operator/test_projection.py`` runs reconcile passes on projected and on whole
objects and checks that they decide and write the same: a field a pass starts to read must be
added here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["KINDS", "attempt_workload", "project", "training_job_of", "workload_essence"]

_SPEC_KEYS: dict[str, tuple[str, ...]] = {
    "jobs": ("suspend", "completions", "parallelism"),
    "pods": ("nodeName", "terminationGracePeriodSeconds"),
    "workloads": ("active", "priority"),  # priority: the boost band (victims.band_top)
}
_STATUS_KEYS: dict[str, tuple[str, ...] | None] = {
    "jobs": None,  # all of it: conditions, counts, times (small)
    "pods": None,  # all of it: phase, conditions, container states and termination messages
    "workloads": ("conditions",),  # not the admission (per-pod-set flavors and counts)
}
KINDS = tuple(_SPEC_KEYS)

# An attempt's Job is <TrainingJob name>-a<N> (render.job_name).
_ATTEMPT_JOB_NAME = re.compile(r".+-a[0-9]+")


def project(body: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A JSON-shaped copy of a child (``kind``: "jobs", "pods" or "workloads") with what a pass
    reads: apiVersion, kind, metadata without managedFields, the spec fields and the status
    fields of its kind."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    spec = body.get("spec") or {}
    status = dict(body.get("status") or {})
    keys = _STATUS_KEYS[kind]
    if keys is not None:
        status = {k: status[k] for k in keys if k in status}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": copy.deepcopy(meta),
        "spec": {k: copy.deepcopy(spec[k]) for k in _SPEC_KEYS[kind] if k in spec},
        "status": copy.deepcopy(status),
    }


def attempt_workload(body: Mapping[str, Any]) -> bool:
    """Whether a Kueue Workload may stand for an attempt's Job: its owner is a batch/v1 Job
    named like one (``<name>-a<N>``). Others (Workloads of other users' Jobs, JobSets, pods)
    are never cached."""
    return training_job_of(body) is not None


def training_job_of(body: Mapping[str, Any]) -> str | None:
    """The name of the TrainingJob whose attempt Job owns this Workload, if it may be one."""
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        name = ref.get("name") or ""
        if (
            ref.get("apiVersion") == "batch/v1"
            and ref.get("kind") == "Job"
            and _ATTEMPT_JOB_NAME.fullmatch(name)
        ):
            return name.rpartition("-a")[0]
    return None


def workload_essence(body: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a Workload can change a pass's decision: the type and reason of its conditions
    that are True (``classify.workload_condition`` reads only those), ``spec.active`` and its
    annotations (the operator's deactivation mark). Kueue adds and rewrites False conditions
    of thousands of pending Workloads (QuotaReserved with the queue's state, PodsReady) in
    waves; such an update must not wake a pass of every queued job."""
    conditions = ((body.get("status") or {}).get("conditions")) or []
    return (
        tuple(
            sorted(
                (c.get("type"), c.get("reason")) for c in conditions if c.get("status") == "True"
            )
        ),
        (body.get("spec") or {}).get("active"),
        tuple(sorted(((body.get("metadata") or {}).get("annotations") or {}).items())),
    )
