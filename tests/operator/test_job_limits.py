"""What platform engineers expect of a training CRD, on the real control plane (issue 30): the
TrainingJob's labels on its Jobs and pods, `kubectl wait --for=condition=Complete|Failed|Suspended`,
progress in status, activeDeadlineSeconds, maxPreemptions and ttlSecondsAfterFinished."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from preemptible_operator import models
from tests.cluster.controlplane import ControlPlane
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions") or []}


def _gone(tj: TJClient, name: str) -> bool:
    try:
        tj.get(name)
        return False
    except ApiException as exc:
        if exc.status != 404:
            raise
    return not tj.jobs(name) and not tj.pods(name)


def _kubectl_wait(control_plane: ControlPlane, tj: TJClient, condition: str, name: str) -> None:
    out = control_plane.kubectl(
        "wait",
        f"--for=condition={condition}",
        f"{models.SINGULAR}/{name}",
        "-n",
        tj.ns,
        "--timeout=150s",
        check=False,
        timeout=170,
    )
    assert out.returncode == 0, (out.stdout, out.stderr, tj.describe(name))


def test_labels_propagate_complete_progress_and_ttl(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    body = toy_training_job("done", checkpoint_root, max_steps=6, ttlSecondsAfterFinished=20)
    body["metadata"]["labels"] = {"team": "nlp"}
    body["metadata"]["annotations"] = {
        "cost-center": "42",
        "kubectl.kubernetes.io/last-applied-configuration": "{}",
    }
    tj.create(body)
    pod = wait_for("a pod", lambda: next(iter(tj.pods("done")), None))
    (job,) = tj.jobs("done")
    for meta in (job.metadata, pod.metadata):
        assert meta.labels["team"] == "nlp", meta.labels
        assert meta.annotations["cost-center"] == "42", meta.annotations
        assert "kubectl.kubernetes.io/last-applied-configuration" not in meta.annotations
    _kubectl_wait(control_plane, tj, "Complete", "done")
    status = tj.status("done")
    assert status["phase"] == "Succeeded"
    complete = _conditions(status)["Complete"]
    assert (complete["status"], complete["reason"]) == ("True", "Completed")
    progress = status["progress"]
    assert (progress["progressPercentage"], progress["estimatedRemainingSeconds"]) == (100, 0)
    # ttlSecondsAfterFinished: the operator deletes it, its Job and pods follow.
    wait_for(
        "TrainingJob deleted after its TTL",
        lambda: _gone(tj, "done"),
        timeout=90,
        on_timeout=lambda: tj.describe("done") + operator.tail(),
    )


def test_ttl_added_to_a_finished_job_deletes_it(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    """Issue 39: a finished job's daemon has ended; an edit (ttlSecondsAfterFinished added)
    must still be acted on, not only after an operator restart."""
    tj.create(toy_training_job("later", checkpoint_root, max_steps=4))
    _kubectl_wait(control_plane, tj, "Complete", "later")
    time.sleep(3)  # its last pass done: no daemon left for it
    tj.patch_spec("later", {"ttlSecondsAfterFinished": 0})
    wait_for(
        "the finished TrainingJob deleted after its TTL was added",
        lambda: _gone(tj, "later"),
        timeout=60,
        on_timeout=lambda: tj.describe("later") + operator.tail(),
    )
    assert operator.alive()


def test_active_deadline_fails_the_job(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    tj.create(
        toy_training_job(
            "late", checkpoint_root, max_steps=100_000, step_sleep=0.2, activeDeadlineSeconds=15
        )
    )
    _kubectl_wait(control_plane, tj, "Failed", "late")
    status = tj.status("late")
    assert status["phase"] == "Failed", tj.describe("late")
    failed = _conditions(status)["Failed"]
    assert (failed["status"], failed["reason"]) == ("True", "DeadlineExceeded"), failed
    assert "activeDeadlineSeconds (15)" in failed["message"]
    assert "raise" not in status["message"]  # the job is over: raising the deadline does nothing
    assert "Complete" not in _conditions(status)
    # The running attempt was stopped through the normal path and recorded before the job
    # went terminal: its end, and the checkpoint its pods wrote at SIGTERM.
    last = status["attempts"][-1]
    assert last.get("endTime") and last["reason"] == "DeadlineExceeded", last
    assert last["outcome"] == "Suspended" and last.get("endStep") is not None, last
    assert status.get("lastCompleteCheckpoint"), status
    assert last.get("checkpoint") == status["lastCompleteCheckpoint"]["path"], status
    # The attempt is stopped and its Job deleted (nothing left for Kueue to admit later).
    wait_for(
        "the attempt's Job and pods gone",
        lambda: not tj.jobs("late") and not tj.pods("late"),
        timeout=120,
        on_timeout=lambda: tj.describe("late") + operator.tail(),
    )
    assert "DeadlineExceeded" in [r for r, _ in tj.events("late")]


def test_max_preemptions_fails_the_job_instead_of_requeueing(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    tj.create(
        toy_training_job("loop", checkpoint_root, max_steps=1000, step_sleep=0.2, maxPreemptions=0)
    )
    pod = wait_for(
        "attempt 1 running",
        lambda: tj.running_pod("loop", 1),
        on_timeout=lambda: tj.describe("loop") + operator.tail(),
    )
    tj.evict(pod.metadata.name)
    _kubectl_wait(control_plane, tj, "Failed", "loop")
    status = tj.status("loop")
    failed = _conditions(status)["Failed"]
    assert (failed["status"], failed["reason"]) == ("True", "PreemptionLimitExceeded"), failed
    assert status["preemptions"] == 1 and status["attempt"] == 1, tj.describe("loop")


def test_suspended_condition_for_kubectl_wait(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    tj.create(toy_training_job("held", checkpoint_root, max_steps=6, suspend=True))
    _kubectl_wait(control_plane, tj, "Suspended", "held")
    assert tj.status("held")["phase"] == "Suspended"
    tj.patch_spec("held", {"suspend": False})
    _kubectl_wait(control_plane, tj, "Complete", "held")
    suspended = _conditions(tj.status("held"))["Suspended"]
    assert (suspended["status"], suspended["reason"]) == ("False", "Resumed"), suspended
