"""A TrainingJob deleted and re-created under the same name and checkpoint.uri, on the real
control plane: the new one resumes from the old checkpoints, may write next to them (attempt
fence), and never adopts or races the old incarnation's Job or pods (one node: no Service)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from preemptible_operator import models
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _manifest_attempt(root: Path, step: int) -> int:
    return int(json.loads((root / f"checkpoint-{step}" / "manifest.json").read_text())["attempt"])


def test_recreated_job_writes_next_to_checkpoints_of_a_later_attempt(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
    tmp_path: Path,
) -> None:
    """Storage holds checkpoints of attempt 5 (an earlier TrainingJob of this name, deleted):
    the new TrainingJob's attempt 1 must resume from them and be allowed to save."""
    root = checkpoint_root / "again"
    earlier = ToyRun(
        root, tmp_path / "earlier", args=["--max-steps", "4", "--save-steps", "2"], attempt=5
    )
    assert earlier.start().wait(180) == 0, earlier.log_file.read_text()[-2000:]
    assert _manifest_attempt(root, 4) == 5

    tj.create(toy_training_job("again", checkpoint_root, max_steps=8, save_steps=2))
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("again", "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe("again") + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe("again") + operator.tail()
    (attempt,) = status["attempts"]
    assert attempt["startStep"] == 4 and attempt["attempt"] == 1
    assert _manifest_attempt(root, 8) > 5


def test_quick_recreate_never_adopts_or_races_the_old_children(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    name = "rc"
    tj.create(toy_training_job(name, checkpoint_root, max_steps=60, step_sleep=0.3))
    wait_for(
        "running at step >= 3",
        lambda: (tj.status(name).get("progress") or {}).get("step", 0) >= 3,
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    old_uid = tj.get(name)["metadata"]["uid"]
    args = (models.GROUP, models.VERSION, tj.ns, models.PLURAL)
    tj.custom.delete_namespaced_custom_object(*args, name)

    def recreate() -> bool:
        try:
            tj.create(toy_training_job(name, checkpoint_root, max_steps=12, step_sleep=0.2))
        except ApiException as exc:
            if exc.status == 409:  # the old object still holds its finalizer
                time.sleep(0.2)
                return False
            raise
        return True

    wait_for("re-created", recreate, timeout=60, interval=0.05)
    new_uid = tj.get(name)["metadata"]["uid"]
    assert new_uid != old_uid
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is(name, "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe(name) + operator.tail()
    (attempt,) = status["attempts"]
    # It resumed from the JIT checkpoint the old pod wrote after the delete: the new attempt
    # started only once the old pod had stopped.
    assert (attempt["startStep"] or 0) >= 3, status
    for job in tj.jobs(name):
        assert [r.uid for r in job.metadata.owner_references] == [new_uid]
    # One node needs no rendezvous Service: neither incarnation created one.
    assert not tj.core.list_namespaced_service(tj.ns, field_selector=f"metadata.name={name}").items
