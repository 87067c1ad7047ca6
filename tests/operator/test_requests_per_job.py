"""What a new TrainingJob costs the apiserver, on the real control plane: kopf's finalizer and
one status write. No diff-base annotation (no kopf change handlers), no status write refused
for a stale resourceVersion and redone, no second write of the same state by the pass the new
Job's events wake, no rendezvous Service for one node."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from preemptible_operator import models, render
from tests.cluster.kueue import Kueue
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.kueue, pytest.mark.slow]


def _modifications(tj: TJClient, name: str, since: str) -> list[dict[str, Any]]:
    """Every version of ``name`` written after resourceVersion ``since`` (a watch replays them)."""
    out: list[dict[str, Any]] = []
    for ev in kubernetes.watch.Watch().stream(
        tj.custom.list_namespaced_custom_object,
        models.GROUP,
        models.VERSION,
        tj.ns,
        models.PLURAL,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=2,
    ):
        if ev["type"] == "MODIFIED":
            out.append(ev["object"])
    return out


def test_a_new_queued_job_costs_the_finalizer_and_one_status_write(
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    name = "once"
    # More CPU than the ClusterQueue holds: the Job stays suspended, the phase Queued.
    body = toy_training_job(name, checkpoint_root, cpu="1000", queueName=kueue.local_queue)
    created = tj.create(body)
    wait_for(
        "Queued with its Job",
        lambda: tj.phase_is(name, "Queued") and tj.jobs(name),
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    time.sleep(3)  # the passes woken by the Job's and the Workload's events
    versions = _modifications(tj, name, created["metadata"]["resourceVersion"])
    shown = [
        (v["metadata"].get("finalizers"), (v.get("status") or {}).get("phase")) for v in versions
    ]
    assert len(versions) == 2, [*shown, operator.tail()]
    final = versions[-1]
    assert final["metadata"]["finalizers"] == ["preemptible.dev/operator"]
    assert not any(
        k.endswith("last-handled-configuration") for k in final["metadata"].get("annotations") or {}
    )
    conds = {c["type"]: c for c in final["status"]["conditions"]}
    # The one write already holds what the next pass decides (waiting for admission).
    assert conds["Admitted"]["reason"] == "Queued", conds
    assert final["status"]["message"] == "waiting for Kueue admission", final["status"]
    services = tj.core.list_namespaced_service(tj.ns, label_selector=render.LABEL_TRAINING_JOB)
    assert not services.items
