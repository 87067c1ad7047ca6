"""TrainingJobs on the real control plane: success, eviction, SIGKILL, invalid objects."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from preemptible_operator import render
from tests.cluster.controlplane import ControlPlane
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_runs_to_success(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    tj.create(toy_training_job("ok", checkpoint_root, max_steps=6, save_steps=3))
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("ok", "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe("ok") + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe("ok")
    assert status["attempt"] == 1
    (attempt,) = status["attempts"]
    assert attempt["outcome"] == "Succeeded" and attempt["exitCodes"] == [0]
    assert status["progress"]["step"] == 6
    assert status["lastCompleteCheckpoint"]["step"] == 6
    assert status.get("preemptions", 0) == 0
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Succeeded"]["status"] == "True"
    assert [j.metadata.name for j in tj.jobs("ok")] == ["ok-a1"]
    reasons = [r for r, _ in tj.events("ok")]
    assert "AttemptCreated" in reasons and "Completed" in reasons
    out = control_plane.kubectl("get", "tj", "-n", tj.ns).stdout
    header = out.splitlines()[0].split()
    assert header == [
        "NAME",
        "PHASE",
        "STEP",
        "CHECKPOINT",
        "ATTEMPT",
        "NODES",
        "PREEMPTIONS",
        "GRACE",
        "SAVE-EVERY",
        "PROGRESS",
        "REMAINING",
        "AGE",
    ], out
    assert out.splitlines()[1].split()[:5] == ["ok", "Succeeded", "6", "6", "1"], out
    # Deleting the TrainingJob releases everything it owns.
    tj.custom.delete_namespaced_custom_object(
        "preemptible.dev", "v1alpha1", tj.ns, "trainingjobs", "ok"
    )
    wait_for(
        "TrainingJob, Job and pods gone",
        lambda: (
            not tj.custom.list_namespaced_custom_object(
                "preemptible.dev", "v1alpha1", tj.ns, "trainingjobs"
            )["items"]
            and not tj.jobs("ok")
            and not tj.pods("ok")
        ),
        on_timeout=lambda: tj.describe("ok") + operator.tail(),
    )


def _wait_step(
    tj: TJClient, name: str, step: int, op: OperatorProcess, checkpoint: int | None = None
) -> dict:
    def probe() -> dict | None:
        s = tj.status(name)
        ok = (s.get("progress") or {}).get("step", 0) >= step and s.get("phase") == "Running"
        if checkpoint is not None:
            ok = ok and (s.get("lastCompleteCheckpoint") or {}).get("step") == checkpoint
        return s if ok else None

    return wait_for(
        f"{name} running at step >= {step}", probe, on_timeout=lambda: tj.describe(name) + op.tail()
    )


def _wait_done(tj: TJClient, name: str, op: OperatorProcess) -> dict:
    return wait_for(
        f"{name} finished",
        lambda: tj.phase_is(name, "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe(name) + op.tail(),
    )


def test_eviction_requeues_and_resumes_from_the_jit_checkpoint(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    tj.create(toy_training_job("evict", checkpoint_root, max_steps=30, step_sleep=0.3))
    _wait_step(tj, "evict", 4, operator)
    pod = tj.running_pod("evict", 1)
    assert pod is not None
    tj.evict(pod.metadata.name)
    # `kubectl get tj` shows the requeue while it happens.
    wait_for(
        "attempt 2",
        lambda: tj.status("evict").get("attempt") == 2,
        on_timeout=lambda: tj.describe("evict") + operator.tail(),
    )
    out = control_plane.kubectl("get", "tj", "evict", "-n", tj.ns).stdout.splitlines()
    row = dict(zip(out[0].split(), out[1].split(), strict=False))
    assert (row["ATTEMPT"], row["NODES"], row["PREEMPTIONS"]) == ("2", "1/1", "1"), out
    status = _wait_done(tj, "evict", operator)
    assert status["phase"] == "Succeeded", tj.describe("evict")
    first, second = status["attempts"]
    assert (first["outcome"], first["reason"]) == ("Preempted", "PodEvicted"), first
    assert first["exitCodes"] == [75] and first["killed"] is False
    assert first["lostSteps"] == 0
    assert first["sigtermToExitSeconds"] > 0
    assert first["checkpoint"].endswith(f"checkpoint-{first['endStep']}")
    assert second["resumeFrom"] == first["checkpoint"]
    assert second["startStep"] == first["endStep"] >= 4
    assert (status["preemptions"], status.get("lostSteps", 0), status.get("failures", 0)) == (
        1,
        0,
        0,
    )
    assert status["progress"]["step"] == 30
    assert status["timings"]["sigtermToExitSecondsMax"] >= first["sigtermToExitSeconds"]
    assert [j.metadata.name for j in tj.jobs("evict")] == ["evict-a2"]  # a1 deleted
    reasons = [r for r, _ in tj.events("evict")]
    assert reasons.count("AttemptCreated") == 1 and "Requeued" in reasons
    assert "PodEvicted" in reasons and "Completed" in reasons
    # The operator's own /metrics saw the same preemption.
    metrics = operator.metrics()
    assert metrics['preemptible_operator_preemptions_total{reason="PodEvicted"}'] == 1, metrics
    key = f'{{name="evict",namespace="{tj.ns}"}}'
    assert metrics.get(f"preemptible_operator_lost_steps_total{key}", 0) == 0, metrics
    assert metrics[f"preemptible_operator_grace_seconds{key}"] > 0, metrics
    assert metrics["preemptible_operator_requeue_seconds_count"] == 1, metrics
    assert metrics["preemptible_operator_reconcile_seconds_count"] > 0, metrics


def test_sigkill_resumes_from_previous_checkpoint_reports_lost_steps_and_raises_grace(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    # A 2 s grace with the runtime's 3 s kill wait: SIGKILL comes before any JIT checkpoint.
    grace = {"initialSeconds": 2, "min": 2, "max": 60}
    tj.create(
        toy_training_job(
            "kill", checkpoint_root, max_steps=14, step_sleep=1.0, save_steps=5, grace=grace
        )
    )
    running = _wait_step(tj, "kill", 6, operator, checkpoint=5)
    # Measured 1 s steps need more than 2 s: the running attempt is flagged.
    sufficient = {c["type"]: c for c in running["conditions"]}["GracePeriodSufficient"]
    assert (sufficient["status"], sufficient["reason"]) == ("False", "GraceTooShort"), sufficient
    assert "grace 2 s is below the measured need" in sufficient["message"]
    pod = tj.running_pod("kill", 1)
    assert pod is not None and pod.spec.termination_grace_period_seconds == 2
    tj.evict(pod.metadata.name)
    status = _wait_done(tj, "kill", operator)
    assert status["phase"] == "Succeeded", tj.describe("kill")
    first, second = status["attempts"][:2]
    assert first["killed"] is True and first["exitCodes"] == [137], first
    assert first["reason"] == "PodEvicted" and first["outcome"] == "Preempted"
    assert first["checkpoint"].endswith("checkpoint-5")
    assert first["endStep"] >= 6 and first["lostSteps"] == first["endStep"] - 5 > 0
    # SIGKILLed: no termination message, so the steps since its last scrape are estimated.
    assert first["lostStepsEstimated"] is True and status["lostStepsEstimated"] is True, first
    assert first["lastScrapedStep"] >= 6 and first["stepsPerSecond"] > 0, first
    assert second["resumeFrom"] == first["checkpoint"] and second["startStep"] == 5
    assert second["graceSeconds"] > first["graceSeconds"] == 2
    assert status["lostSteps"] == first["lostSteps"]
    reasons = [r for r, _ in tj.events("kill")]
    assert "LostSteps" in reasons and "KilledAtGraceDeadline" in reasons


def test_invalid_objects(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    # Structural errors: the apiserver rejects them with its own message.
    bad = toy_training_job("bad", checkpoint_root, numNodes="two")
    with pytest.raises(ApiException) as info:
        tj.create(bad)
    assert info.value.status == 422 and "spec.numNodes" in info.value.body
    missing = toy_training_job("bad", checkpoint_root)
    del missing["spec"]["image"]
    with pytest.raises(ApiException) as info:
        tj.create(missing)
    assert info.value.status == 422 and "spec.image" in info.value.body
    # Semantic errors are refused too (CEL rules: tests/operator/test_crd_validation.py). What
    # the apiserver accepts and the operator cannot use is Failed with reason InvalidSpec.
    long_name = "n" * (render.MAX_NAME_LENGTH + 1)
    tj.create(toy_training_job(long_name, checkpoint_root))
    status = _wait_done(tj, long_name, operator)
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert (status["phase"], failed["reason"]) == ("Failed", "InvalidSpec"), status
    assert failed["message"].startswith("metadata.name"), failed
    assert tj.jobs(long_name) == []
    assert operator.alive(), operator.tail()
