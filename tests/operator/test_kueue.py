"""A TrainingJob preempted by Kueue (a higher-priority Job takes its quota) requeues through
Kueue and resumes from its JIT checkpoint with no lost steps."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import kubernetes
import pytest
import torch

from tests.cluster.controlplane import ControlPlane
from tests.cluster.helpers import job_manifest, python_container
from tests.cluster.kueue import KUEUE_GROUP, KUEUE_VERSION, Kueue
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.kueue, pytest.mark.slow]


def test_kueue_preemption_requeues_and_resumes(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    least_privilege_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    # The operator runs with only its documented RBAC (Workloads: list, patch).
    operator = least_privilege_operator
    assert tj.ns == kueue_namespace
    quota_cpu = kueue.quota["cpu"]
    body = toy_training_job(
        "kq",
        checkpoint_root,
        max_steps=30,
        step_sleep=0.3,
        cpu=quota_cpu,
        queueName=kueue.local_queue,
        priorityClass=kueue.low_priority,
    )
    tj.create(body)
    (job,) = wait_for("attempt 1 Job", lambda: tj.jobs("kq"))
    assert job.metadata.labels[kueue.queue_label] == kueue.local_queue
    assert job.metadata.labels[kueue.priority_label] == kueue.low_priority
    wait_for(
        "running at step >= 4",
        lambda: (tj.status("kq").get("progress") or {}).get("step", 0) >= 4,
        on_timeout=lambda: tj.describe("kq") + operator.tail(),
    )
    conds = {c["type"]: c for c in tj.status("kq")["conditions"]}
    assert conds["Admitted"]["status"] == "True"

    # A high-priority Job that needs the whole quota: Kueue preempts the TrainingJob.
    high = job_manifest(
        "high",
        [python_container("import time; time.sleep(6)", cpu=quota_cpu)],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    batch = kubernetes.client.BatchV1Api(control_plane.api_client())
    batch.create_namespaced_job(tj.ns, high)

    # While the high Job holds the quota, attempt 2 waits in the queue.
    status = wait_for(
        "attempt 2 queued",
        lambda: (s := tj.status("kq")).get("attempt") == 2 and s,
        on_timeout=lambda: tj.describe("kq") + operator.tail(),
    )
    first = status["attempts"][0]
    assert (first["outcome"], first["reason"]) == ("Preempted", "KueuePreempted"), first
    assert first["exitCodes"] == [75] and first["lostSteps"] == 0

    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("kq", "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe("kq") + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe("kq")
    first, second = status["attempts"]
    assert second["resumeFrom"] == first["checkpoint"]
    assert second["startStep"] == first["endStep"] >= 4
    assert (status["preemptions"], status.get("lostSteps", 0)) == (1, 0)
    assert status["progress"]["step"] == 30
    high_job = batch.read_namespaced_job("high", tj.ns)
    assert any(c.type == "Complete" and c.status == "True" for c in high_job.status.conditions)
    assert [j.metadata.name for j in tj.jobs("kq")] == ["kq-a2"]
    assert "KueuePreempted" in [r for r, _ in tj.events("kq")]
    log = operator.log.read_text(errors="replace")
    assert "Forbidden" not in log and " 403" not in log, operator.tail(200)


def test_a_workload_deactivated_by_an_administrator_suspends_the_training_job(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    least_privilege_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    """An administrator deactivates the running attempt's Workload (issue 30): Kueue stops the
    attempt, the operator suspends the TrainingJob (spec.suspend) instead of creating a fresh,
    active Workload, and only the owner's spec.suspend: false resumes it."""
    operator = least_privilege_operator
    body = toy_training_job(
        "kd",
        checkpoint_root,
        max_steps=30,
        step_sleep=0.3,
        cpu=kueue.quota["cpu"],
        queueName=kueue.local_queue,
        priorityClass=kueue.low_priority,
    )
    tj.create(body)
    (job,) = wait_for("attempt 1 Job", lambda: tj.jobs("kd"))
    wait_for(
        "running at step >= 4",
        lambda: (tj.status("kd").get("progress") or {}).get("step", 0) >= 4,
        on_timeout=lambda: tj.describe("kd") + operator.tail(),
    )
    workload = wait_for("its Workload", lambda: kueue.workload_for_job(tj.ns, job.metadata.uid))
    custom = kubernetes.client.CustomObjectsApi(control_plane.api_client())
    custom.patch_namespaced_custom_object(
        KUEUE_GROUP,
        KUEUE_VERSION,
        tj.ns,
        "workloads",
        workload["metadata"]["name"],
        {"spec": {"active": False}},
    )

    status = wait_for(
        "Suspended",
        lambda: tj.phase_is("kd", "Suspended", "Failed", "Succeeded"),
        on_timeout=lambda: tj.describe("kd") + operator.tail(),
    )
    assert status["phase"] == "Suspended", tj.describe("kd")
    assert tj.get("kd")["spec"]["suspend"] is True
    (first,) = status["attempts"]
    assert (first["outcome"], first["reason"]) == ("Suspended", "WorkloadDeactivated"), first
    assert first["exitCodes"] == [75] and first["lostSteps"] == 0, first
    running = {c["type"]: c for c in status["conditions"]}["Running"]
    assert running["reason"] == "WorkloadDeactivated", running
    # Nothing undoes the administrator's decision: no new attempt, no active Workload.
    time.sleep(5)
    assert tj.status("kd")["attempt"] == 1
    assert [j.metadata.name for j in tj.jobs("kd")] in ([], ["kd-a1"])
    for wl in kueue.workloads(tj.ns):
        if wl["metadata"]["name"] == workload["metadata"]["name"]:
            assert wl["spec"].get("active") is False, wl

    tj.patch_spec("kd", {"suspend": False})
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("kd", "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe("kd") + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe("kd")
    first, second = status["attempts"]
    assert second["resumeFrom"] == first["checkpoint"]
    assert second["startStep"] == first["endStep"] >= 4
    assert "WorkloadDeactivated" in [r for r, _ in tj.events("kd")]
    log = operator.log.read_text(errors="replace")
    assert "Forbidden" not in log and " 403" not in log, operator.tail(200)


STOCK_SCRIPT = Path(__file__).resolve().parents[1] / "runtime" / "hf_stock_script.py"
# Bit-identical weights need the same kernels: one thread in the pods and in the reference run.
SAME_THREADS = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def test_kueue_preempts_a_stock_transformers_job_that_resumes_exactly(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tj: TJClient,
    least_privilege_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    """An unmodified transformers.Trainer script (issue 14) run through
    ``python -m trainer_runtime.hf.run``: Kueue preempts it, the operator requeues it, and the
    resumed run ends with the weights of an uninterrupted transformers run."""
    pytest.importorskip("transformers")
    operator = least_privilege_operator
    quota_cpu = kueue.quota["cpu"]
    steps = 16
    # The reference: the same script, uninterrupted, transformers alone (no integration).
    reference = checkpoint_root / "reference"
    subprocess.run(
        [sys.executable, "-P", str(STOCK_SCRIPT), "--output-dir", str(reference / "out"),
         "--max-steps", str(steps), "--final-dir", str(reference / "final")],
        check=True, capture_output=True, timeout=300, env={**os.environ, **SAME_THREADS},
    )  # fmt: skip
    final = checkpoint_root / "final"
    body = toy_training_job(
        "hfq", checkpoint_root, cpu=quota_cpu, queueName=kueue.local_queue,
        priorityClass=kueue.low_priority,
    )  # fmt: skip
    body["spec"]["command"] = ["python", "-m", "trainer_runtime.hf.run", str(STOCK_SCRIPT)]
    body["spec"]["env"] = [{"name": k, "value": v} for k, v in SAME_THREADS.items()]
    body["spec"]["args"] = [
        "--output-dir", "/ignored", "--max-steps", str(steps), "--save-steps", "100",
        "--step-sleep", "0.5", "--final-dir", str(final),
    ]  # fmt: skip
    tj.create(body)
    wait_for(
        "running at step >= 3",
        lambda: (tj.status("hfq").get("progress") or {}).get("step", 0) >= 3,
        timeout=180,
        on_timeout=lambda: tj.describe("hfq") + operator.tail(),
    )
    high = job_manifest(
        "high-hf",
        [python_container("import time; time.sleep(4)", cpu=quota_cpu)],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    batch = kubernetes.client.BatchV1Api(control_plane.api_client())
    batch.create_namespaced_job(tj.ns, high)
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("hfq", "Succeeded", "Failed"),
        timeout=300,
        on_timeout=lambda: tj.describe("hfq") + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe("hfq")
    first, second = status["attempts"]
    assert (first["outcome"], first["reason"]) == ("Preempted", "KueuePreempted"), first
    assert first["exitCodes"] == [75] and first["lostSteps"] == 0
    assert second["resumeFrom"] == first["checkpoint"]
    assert second["startStep"] == first["endStep"] >= 3
    assert (status["preemptions"], status.get("lostSteps", 0)) == (1, 0)
    assert status["progress"]["step"] == steps

    from safetensors.torch import load_file

    ours = load_file(str(final / "model.safetensors"))
    theirs = load_file(str(reference / "final" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), "weights differ"
