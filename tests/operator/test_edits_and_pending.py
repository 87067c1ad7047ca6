"""On the real control plane: an invalid edit of a running TrainingJob is rejected while its
attempt goes on; a pod that cannot be scheduled is explained in the status."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_invalid_edit_of_a_running_job_is_rejected_and_the_attempt_goes_on(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    name = "edit"
    tj.create(toy_training_job(name, checkpoint_root, max_steps=20, step_sleep=0.3))
    wait_for(
        "running",
        lambda: (tj.status(name).get("progress") or {}).get("step", 0) >= 2,
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    # min above max passes the CRD schema (a cross-field rule) but not the operator's models.
    tj.patch_spec(name, {"gracePeriod": {"initialSeconds": 30, "min": 100, "max": 50}})
    wait_for(
        "SpecChangeRejected event",
        lambda: "SpecChangeRejected" in [r for r, _ in tj.events(name)],
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    status = wait_for(
        "finished",
        lambda: tj.phase_is(name, "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe(name) + operator.tail()
    assert [a["attempt"] for a in status["attempts"]] == [1]
    assert status["progress"]["step"] == 20


def test_pending_says_why_the_pod_is_not_scheduled(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    name = "nopvc"
    body = toy_training_job(name, checkpoint_root, max_steps=2)
    body["spec"]["volumes"].append(
        {"name": "data", "persistentVolumeClaim": {"claimName": "does-not-exist"}}
    )
    tj.create(body)
    status = wait_for(
        "Pending with the scheduler's reason",
        lambda: (
            (s := tj.status(name)).get("phase") == "Pending"
            and "does-not-exist" in (s.get("message") or "")
            and s
        ),
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    assert "Unschedulable" in status["message"], status["message"]
