"""An elastic TrainingJob (spec.elastic, issue 40) on the real control plane and Kueue v0.19.2,
run by the operator with only its documented RBAC and admission policies: it creates the
TrainingJob's own Workload, starts at once on the pods the free quota allows (the attempt Job
carries no Kueue label and gets the elastic env), and a Kueue preemption stops it through the
JIT path and requeues the SAME Workload (same uid), which is admitted again at the full size.
docs/elastic.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes
import pytest

from preemptible_operator import workload as wlib
from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import job_manifest, python_container
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for
from trainer_runtime import protocol

pytestmark = [pytest.mark.cluster, pytest.mark.kueue, pytest.mark.slow]


def _condition(workload: dict[str, Any], kind: str) -> dict[str, Any]:
    for cond in (workload.get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return {}


def _env(job: Any) -> dict[str, str | None]:
    (container,) = job.spec.template.spec.containers
    return {e.name: e.value for e in container.env}


def _start_blocker(batch: Any, kueue: Kueue, namespace: str) -> None:
    """A low-priority Job of 1 CPU, admitted by Kueue: half the session's 2-CPU queue."""
    batch.create_namespaced_job(
        namespace,
        job_manifest(
            "blocker",
            [python_container("import time; time.sleep(300)", cpu="1")],
            labels=kueue.job_labels(kueue.low_priority),
            suspend=True,
        ),
    )
    wait_for(
        "the blocker admitted",
        lambda: batch.read_namespaced_job("blocker", namespace).spec.suspend is False,
    )


def test_elastic_job_starts_small_and_a_preemption_requeues_its_own_workload(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    least_privilege_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    operator = least_privilege_operator
    assert kueue.quota["cpu"] == "2", "the test sizes its pods for the session's 2-CPU queue"
    batch = kubernetes.client.BatchV1Api(control_plane.api_client())
    custom = kubernetes.client.CustomObjectsApi(control_plane.api_client())
    workload_name = wlib.workload_name("el")

    def workload() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(
            wlib.KUEUE_GROUP, wlib.KUEUE_VERSION, tj.ns, "workloads", workload_name
        )

    def admitted(name: str) -> bool:
        job = batch.read_namespaced_job(name, tj.ns)
        return job.spec.suspend is False

    try:
        # A low-priority blocker holds 1 of the queue's 2 CPUs: only 1 pod of quota is free.
        _start_blocker(batch, kueue, tj.ns)

        body = toy_training_job(
            "el",
            checkpoint_root,
            max_steps=40,
            step_sleep=0.25,
            cpu="1",
            numNodes=2,
            elastic={"minNodes": 1},
            queueName=kueue.local_queue,
            priorityClass=kueue.low_priority,
        )
        tj.create(body)

        # Admitted partially (1 of 2) and started at once on 1 pod, not waiting for 2.
        (job,) = wait_for(
            "attempt 1 Job",
            lambda: tj.jobs("el"),
            on_timeout=lambda: tj.describe("el") + operator.tail(),
        )
        assert job.spec.completions == job.spec.parallelism == 1
        assert job.spec.suspend is False
        assert kueue.queue_label not in (job.metadata.labels or {}), "Kueue must not manage it"
        env = _env(job)
        assert env[protocol.ENV_ELASTIC_REFERENCE_NODES] == "2"
        assert env[protocol.ENV_ELASTIC_ACCUMULATION] == "1"
        first_wl = workload()
        uid = first_wl["metadata"]["uid"]
        assert first_wl["status"]["admission"]["podSetAssignments"][0]["count"] == 1
        wait_for(
            "running at step >= 3",
            lambda: (tj.status("el").get("progress") or {}).get("step", 0) >= 3,
            on_timeout=lambda: tj.describe("el") + operator.tail(),
        )
        status = tj.status("el")
        assert status["nodes"] == "1/2" and status["attempts"][0]["nodes"] == 1
        assert status["workload"] == workload_name, status
        scaled = [m for r, m in tj.events("el") if r == "ScaledDown"]
        assert scaled and "2 -> 1 pod(s): Kueue admitted 1" in scaled[0], tj.events("el")

        # A high-priority Job needing the whole quota: Kueue evicts the TrainingJob's Workload;
        # the operator stops the attempt (JIT checkpoint) and releases the reservation.
        batch.create_namespaced_job(
            tj.ns,
            job_manifest(
                "high",
                [python_container("import time; time.sleep(3)", cpu="2")],
                labels=kueue.job_labels(kueue.high_priority),
                suspend=True,
            ),
        )
        status = wait_for(
            "attempt 1 recorded",
            lambda: (s := tj.status("el")).get("attempts", [{}])[0].get("outcome") and s,
            on_timeout=lambda: tj.describe("el") + operator.tail(),
        )
        first = status["attempts"][0]
        assert (first["outcome"], first["reason"]) == ("Preempted", "KueuePreempted"), first
        assert first["exitCodes"] == [75] and first.get("lostSteps", 0) == 0, first
        wait_for("the preemptor admitted", lambda: admitted("high"))
        requeued = workload()
        assert requeued["metadata"]["uid"] == uid, "the same Workload requeues"
        assert _condition(requeued, "Requeued").get("status") == "True", requeued["status"]
        # The blocker goes, then the preemptor ends: the same Workload gets the whole quota.
        batch.delete_namespaced_job("blocker", tj.ns, propagation_policy="Background")
        status = wait_for(
            "attempt 2 on 2 pods",
            lambda: (s := tj.status("el")).get("attempt") == 2 and s.get("nodes") == "2/2" and s,
            timeout=60,
            on_timeout=lambda: tj.describe("el") + operator.tail(),
        )
        assert workload()["metadata"]["uid"] == uid
        assert any(r == "ScaledUp" for r, _ in tj.events("el")), tj.events("el")
        log = operator.log.read_text(errors="replace")
        assert "Forbidden" not in log and " 403" not in log, operator.tail(200)
    finally:
        for name in ("blocker", "high"):
            try:
                batch.delete_namespaced_job(name, tj.ns, propagation_policy="Background")
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
