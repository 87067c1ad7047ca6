"""A rollback of the operator on the real control plane: the CRD stays the newer one (helm never
downgrades CRDs), a newer operator has written status fields this version does not know, at the
top and nested in an attempt record. This version must keep reconciling the job (not raise on
every pass) and must not drop those fields when it writes the status."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from preemptible_operator import crd, models
from tests.cluster.controlplane import ControlPlane
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    install_crd,
    toy_training_job,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NESTED = "futureField"
TOP = "futureSummary"
# Enum values a newer version added to its CRD and wrote: a phase, a condition status.
NEWER_PHASE = "Resizing"
NEWER_CONDITION = {"type": "FutureReady", "status": "Partly", "reason": "Probe"}


def _newer_crd() -> dict[str, Any]:
    """The generated CRD plus the status fields a newer operator version declares."""
    body = copy.deepcopy(crd.build_crd())
    status = body["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    status["properties"][TOP] = {"type": "string", "description": "Added by a newer version."}
    status["properties"]["attempts"]["items"]["properties"][NESTED] = {
        "type": "object",
        "description": "Added by a newer version.",
        "properties": {"kind": {"type": "string"}, "count": {"type": "integer"}},
    }
    status["properties"]["phase"]["enum"].append(NEWER_PHASE)
    status["properties"]["conditions"]["items"]["properties"]["status"]["enum"].append(
        NEWER_CONDITION["status"]
    )
    return body


@pytest.fixture
def newer_crd(control_plane: ControlPlane, tj_crd: None) -> Iterator[None]:
    with control_plane.api_client() as client:
        install_crd(client, _newer_crd())
    try:
        yield
    finally:
        # Other tests share the control plane: put the generated CRD back.
        with control_plane.api_client() as client:
            install_crd(client)


def _write_newer_fields(tj: TJClient, name: str) -> None:
    """What the newer operator had written: through the status subresource, retried on a
    conflict with this operator's own writes."""
    for _ in range(20):
        obj = tj.get(name)
        status = obj["status"]
        status[TOP] = "written by v-next"
        status["attempts"][0][NESTED] = {"kind": "probe", "count": 3}
        status["phase"] = NEWER_PHASE
        status["conditions"] = [*(status.get("conditions") or []), NEWER_CONDITION]
        try:
            tj.custom.replace_namespaced_custom_object_status(
                models.GROUP, models.VERSION, tj.ns, models.PLURAL, name, obj
            )
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise AssertionError("status kept conflicting")


def test_rolled_back_operator_reconciles_and_keeps_newer_status_fields(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    newer_crd: None,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    name = "rollback"
    tj.create(toy_training_job(name, checkpoint_root, max_steps=40, save_steps=10))
    wait_for(
        "attempt 1 recorded while it runs",
        lambda: tj.phase_is(name, "Running") and tj.status(name).get("attempts"),
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    _write_newer_fields(tj, name)
    stored = tj.status(name)
    assert stored[TOP] and stored["attempts"][0][NESTED], "the newer CRD pruned the fields"
    assert NEWER_CONDITION in stored["conditions"], "the newer CRD refused the enum value"

    status = wait_for(
        "Succeeded after the newer fields were written",
        lambda: tj.phase_is(name, "Succeeded", "Failed"),
        timeout=150,
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe(name)
    (attempt,) = status["attempts"]
    assert attempt["outcome"] == "Succeeded" and attempt["endStep"] == 40
    # Written back unchanged by every pass since: a roll forward finds what it recorded.
    assert attempt[NESTED] == {"kind": "probe", "count": 3}
    assert status[TOP] == "written by v-next"
    # A condition this version does not manage keeps its newer enum value; the phase is this
    # version's own again.
    assert NEWER_CONDITION in status["conditions"]
    assert "validation error" not in operator.tail(400)
