"""Children the apiserver refuses, pods held by a sidecar, and the failed attempt's Job kept for
its logs, on the real control plane (issue 30, second review).

- a 2-node TrainingJob whose Service name is taken by someone else's Service: condition
  CreateRefused (ChildNameTaken) with the apiserver's story, a Warning Event, phase Pending; the
  attempt starts once the Service is gone;
- a Job the apiserver refuses with 422 (an invalid podTemplate field): Failed, ChildInvalid;
- a ResourceQuota that refuses the pods (the Job controller's FailedCreate): PodsRefused while
  it holds, cleared once the pods exist;
- a regular sidecar that keeps the pod running after the trainer exits: the attempt still ends;
- the final failed attempt's Job and pods stay (no finalizer, no running pod) for their logs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _describe(tj: TJClient, name: str, op: OperatorProcess) -> str:
    return tj.describe(name) + "\n" + op.tail()


def _condition(tj: TJClient, name: str, ctype: str) -> dict[str, Any] | None:
    for c in tj.status(name).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return None


def _refused(tj: TJClient, name: str, reason: str) -> dict[str, Any] | None:
    c = _condition(tj, name, "CreateRefused")
    return c if c and c["status"] == "True" and c["reason"] == reason else None


def test_service_name_taken_is_shown_and_retried(
    tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    tj.core.create_namespaced_service(
        tj.ns,
        {
            "metadata": {"name": "taken"},
            "spec": {"clusterIP": "None", "ports": [{"port": 80}]},
        },
    )
    tj.create(toy_training_job("taken", checkpoint_root, numNodes=2))
    c = wait_for(
        "CreateRefused ChildNameTaken",
        lambda: _refused(tj, "taken", "ChildNameTaken"),
        on_timeout=lambda: _describe(tj, "taken", operator),
    )
    assert "not owned by TrainingJob taken" in c["message"]
    status = tj.status("taken")
    assert status["phase"] == "Pending" and "Service" in status["message"], status
    assert tj.jobs("taken") == []
    wait_for(
        "ChildNameTaken Warning Event",
        lambda: "ChildNameTaken" in [r for r, _ in tj.events("taken")],
        timeout=30,
        on_timeout=lambda: str(tj.events("taken")),
    )
    tj.core.delete_namespaced_service("taken", tj.ns)
    wait_for(
        "attempt 1 Job once the name is free",
        lambda: [j.metadata.name for j in tj.jobs("taken")] == ["taken-a1"],
        on_timeout=lambda: _describe(tj, "taken", operator),
    )
    wait_for(
        "CreateRefused cleared",
        lambda: (_condition(tj, "taken", "CreateRefused") or {}).get("status") == "False",
        timeout=30,
        on_timeout=lambda: _describe(tj, "taken", operator),
    )


def test_job_refused_as_invalid_fails_the_training_job(
    tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    body = toy_training_job("bad", checkpoint_root)
    # Valid for the CRD (a free-form partial PodSpec), refused by the Job's validation.
    body["spec"]["podTemplate"] = {
        "spec": {
            "containers": [
                {
                    "name": "side",
                    "image": "preemptible:test",
                    "ports": [{"containerPort": 70000}],
                }
            ]
        }
    }
    tj.create(body)
    status = wait_for(
        "Failed",
        lambda: tj.phase_is("bad", "Failed", "Succeeded", "Running"),
        on_timeout=lambda: _describe(tj, "bad", operator),
    )
    assert status["phase"] == "Failed", status
    failed = {c["type"]: c for c in status["conditions"]}
    assert failed["Failed"]["reason"] == "ChildInvalid"
    assert failed["CreateRefused"]["reason"] == "ChildInvalid"
    assert "containerPort" in failed["CreateRefused"]["message"], failed
    assert "containerPort" in status["message"]
    assert tj.jobs("bad") == []
    wait_for(
        "ChildInvalid Warning Event",
        lambda: "ChildInvalid" in [r for r, _ in tj.events("bad")],
        timeout=30,
        on_timeout=lambda: str(tj.events("bad")),
    )


def test_pods_refused_by_a_resource_quota(
    tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    tj.core.create_namespaced_resource_quota(
        tj.ns, {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}}
    )
    # The quota controller must have computed its usage before it admits or refuses anything.
    wait_for(
        "quota status",
        lambda: tj.core.read_namespaced_resource_quota("no-pods", tj.ns).status.hard or {},
        timeout=60,
    )
    tj.create(toy_training_job("quota", checkpoint_root))
    c = wait_for(
        "CreateRefused PodsRefused",
        lambda: _refused(tj, "quota", "PodsRefused"),
        on_timeout=lambda: _describe(tj, "quota", operator),
    )
    assert "exceeded quota" in c["message"], c
    status = tj.status("quota")
    assert status["phase"] == "Pending" and "exceeded quota" in status["message"], status
    wait_for(
        "PodsRefused Warning Event",
        lambda: "PodsRefused" in [r for r, _ in tj.events("quota")],
        timeout=30,
        on_timeout=lambda: str(tj.events("quota")),
    )
    tj.core.delete_namespaced_resource_quota("no-pods", tj.ns)
    # The Job controller retries with its own backoff; the condition clears once pods exist.
    wait_for(
        "pods created and CreateRefused cleared",
        lambda: (
            tj.pods("quota")
            and (_condition(tj, "quota", "CreateRefused") or {}).get("status") == "False"
        ),
        on_timeout=lambda: _describe(tj, "quota", operator),
    )


def test_a_regular_sidecar_does_not_keep_the_attempt_running(
    node_agent: NodeAgent, tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    body = toy_training_job("side", checkpoint_root, max_steps=6, step_sleep=0.1)
    body["spec"]["podTemplate"] = {
        "spec": {
            "containers": [
                {
                    "name": "log-shipper",
                    "image": "preemptible:test",
                    "command": ["python", "-c", "import time; time.sleep(3600)"],
                }
            ]
        }
    }
    tj.create(body)
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("side", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, "side", operator),
    )
    assert status["phase"] == "Succeeded", _describe(tj, "side", operator)
    (attempt,) = status["attempts"]
    assert attempt["outcome"] == "Succeeded" and attempt["exitCodes"] == [0]


def test_the_last_failed_attempts_job_and_pods_are_kept(
    node_agent: NodeAgent, tj: TJClient, operator: OperatorProcess, checkpoint_root: Path
) -> None:
    tj.create(
        toy_training_job(
            "keep",
            checkpoint_root,
            max_steps=10,
            step_sleep=0.1,
            extra_args=("--fail-at-step", "2"),
            maxRestarts=1,
            restartBackoffSeconds=1,
        )
    )
    status = wait_for(
        "Failed",
        lambda: tj.phase_is("keep", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, "keep", operator),
    )
    assert status["phase"] == "Failed"
    assert {c["type"]: c for c in status["conditions"]}["Failed"]["reason"] == "RestartsExhausted"

    def settled() -> list[str] | None:
        names = sorted(j.metadata.name for j in tj.jobs("keep"))
        pods = tj.pods("keep")
        if names == ["keep-a2"] and pods and not any(p.metadata.finalizers for p in pods):
            return names
        return None

    # Attempt 1's Job goes once attempt 2 failed too; attempt 2's stays with its pod.
    wait_for("only the last failed Job left", settled, timeout=60,
             on_timeout=lambda: _describe(tj, "keep", operator))  # fmt: skip
    (job,) = tj.jobs("keep")
    assert not job.metadata.deletion_timestamp
    assert any(c.type == "Failed" and c.status == "True" for c in job.status.conditions or [])
    assert not job.status.active
    pods = tj.pods("keep", 2)
    assert pods and all(p.status.phase == "Failed" for p in pods), _describe(tj, "keep", operator)
    # Still there a while later: nothing cleans it up until the TrainingJob is deleted.
    time.sleep(3)
    assert tj.batch.read_namespaced_job("keep-a2", tj.ns).metadata.deletion_timestamp is None
