"""Issue 30, on the real control plane: the operator's path map points at a volume of its own
that does not hold the pods' checkpoints (the chart maps the operator's own PVC path for every
namespace, while a TrainingJob writes to a PVC of its namespace). A TrainingJob re-created over
its old checkpoints must still resume from them on attempt 1: the operator, which cannot see
them, passes ``latest`` and the runtime finds them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    delete_training_jobs,
    toy_training_job,
    wait_for,
)
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _manifest_attempt(root: Path, step: int) -> int:
    return int(json.loads((root / f"checkpoint-{step}" / "manifest.json").read_text())["attempt"])


@pytest.fixture
def operator_elsewhere(
    control_plane: ControlPlane,
    tj_crd: None,
    namespace: str,
    checkpoint_root: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[tuple[OperatorProcess, Path]]:
    """The operator reading ``checkpoint_root`` (the pods' path) from another directory."""
    elsewhere = tmp_path / "operator-volume"
    elsewhere.mkdir()
    op = OperatorProcess(
        control_plane.kubeconfig, namespace, checkpoint_root, tmp_path / "operator.log"
    )
    i = op.argv.index("--checkpoint-path-map")
    op.argv[i + 1] = f"{checkpoint_root}={elsewhere}"
    op.start()
    try:
        yield op, elsewhere
    finally:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            print(f"--- operator log ({op.log}) ---\n{op.tail(120)}")
        with control_plane.api_client() as client:
            delete_training_jobs(client, namespace, op)
        op.kill()


@pytest.mark.parametrize("operator_sees", ["missing", "empty"])
def test_recreated_job_resumes_from_checkpoints_the_operator_cannot_see(
    node_agent: NodeAgent,
    tj: TJClient,
    operator_elsewhere: tuple[OperatorProcess, Path],
    checkpoint_root: Path,
    tmp_path: Path,
    operator_sees: str,
) -> None:
    operator, elsewhere = operator_elsewhere
    root = checkpoint_root / "again"
    if operator_sees == "empty":
        (elsewhere / "again").mkdir()  # the operator's volume has the directory, empty
    earlier = ToyRun(
        root, tmp_path / "earlier", args=["--max-steps", "4", "--save-steps", "2"], attempt=5
    )
    assert earlier.start().wait(180) == 0, earlier.log_file.read_text()[-2000:]

    tj.create(toy_training_job("again", checkpoint_root, max_steps=8, save_steps=2))
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("again", "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe("again") + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe("again") + operator.tail()
    (attempt,) = status["attempts"]
    assert attempt["resumeFrom"] == "latest", status
    # Resumed at step 4: the earlier checkpoints were not written again (a fresh start would
    # have saved checkpoint-2 and checkpoint-4 anew, with its own attempt value).
    assert _manifest_attempt(root, 2) == 5 and _manifest_attempt(root, 4) == 5
    assert _manifest_attempt(root, 8) > 5
    assert status["lastCompleteCheckpoint"]["step"] == 8  # the runtime's report


def test_a_requeued_attempt_gets_latest_when_the_operator_cannot_see_the_storage(
    node_agent: NodeAgent,
    tj: TJClient,
    operator_elsewhere: tuple[OperatorProcess, Path],
    checkpoint_root: Path,
) -> None:
    """Issue 37: what the operator merely heard from the pods (here attempt 1's termination
    message) is never sent as a path: it can be older than the newest complete checkpoint on
    the volume. Attempt 2 gets ``latest``, expects at least the reported step, and the runtime
    resumes from the newest complete checkpoint (the JIT one), 0 steps lost."""
    operator, _ = operator_elsewhere
    tj.create(toy_training_job("unseen", checkpoint_root, max_steps=30, step_sleep=0.3))

    def running_at_4() -> dict | None:
        s = tj.status("unseen")
        return s if (s.get("progress") or {}).get("step", 0) >= 4 else None

    wait_for("step 4", running_at_4, on_timeout=lambda: tj.describe("unseen") + operator.tail())
    pod = tj.running_pod("unseen", 1)
    assert pod is not None
    tj.evict(pod.metadata.name)
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("unseen", "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe("unseen") + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe("unseen") + operator.tail()
    first, second = status["attempts"]
    assert first["outcome"] == "Preempted" and first["exitCodes"] == [75], first
    assert second["resumeFrom"] == "latest", second  # before: first["checkpoint"], as heard
    # startStep: what the runtime says it loaded, the JIT checkpoint attempt 1 reported
    assert second["startStep"] == first["endStep"] >= 4, status
    assert second.get("resumedFrom") == first["checkpoint"], second
    assert status.get("lostSteps", 0) == 0, status
    reasons = [reason for reason, _ in tj.events("unseen")]
    assert "ResumeFellBack" not in reasons, reasons
