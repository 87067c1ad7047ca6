"""The operator runs with exactly the RBAC rules it documents (preemptible_operator.rbac), as a
ServiceAccount: a preemption and a requeue work, and nothing it does is forbidden."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    toy_training_job,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_operator_with_documented_rbac_only(
    node_agent: NodeAgent,
    tj: TJClient,
    least_privilege_operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    op = least_privilege_operator
    tj.create(toy_training_job("rb", checkpoint_root, max_steps=20, step_sleep=0.3))
    wait_for(
        "running at step >= 3",
        lambda: (tj.status("rb").get("progress") or {}).get("step", 0) >= 3,
        on_timeout=lambda: tj.describe("rb") + op.tail(),
    )
    pod = tj.running_pod("rb", 1)
    assert pod is not None
    tj.evict(pod.metadata.name)
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("rb", "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe("rb") + op.tail(),
    )
    assert status["phase"] == "Succeeded"
    assert [a["reason"] for a in status["attempts"]] == ["PodEvicted", "Completed"]
    assert status.get("lostSteps", 0) == 0
    log = op.log.read_text(errors="replace")
    assert "Forbidden" not in log and " 403" not in log, op.tail(200)
