"""On the real control plane: an invalid spec that got past the apiserver (stored under a CRD
without today's rules) does not stop a running TrainingJob: the edit is rejected while its attempt
goes on; a pod that cannot be scheduled is explained in the status."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from preemptible_operator import crd, models
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    install_crd,
    toy_training_job,
    wait_for,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _without_rules(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_rules(v) for k, v in node.items() if k != "x-kubernetes-validations"}
    if isinstance(node, list):
        return [_without_rules(v) for v in node]
    return node


def _accepted(tj: TJClient, name: str, spec: dict[str, Any]) -> bool:
    try:
        tj.custom.patch_namespaced_custom_object(
            models.GROUP, models.VERSION, tj.ns, models.PLURAL, name, {"spec": spec}, dry_run="All"
        )
    except ApiException as exc:
        if exc.status != 422:
            raise
        return False
    return True


# Differs from what the test stores: once the rules are back, the apiserver ratchets (lets an
# unchanged invalid field through) but refuses a changed one.
_PROBE = {"gracePeriod": {"initialSeconds": 30, "min": 7, "max": 6}}


@contextmanager
def crd_without_rules(tj: TJClient, probe: str) -> Iterator[None]:
    """The CRD without its CEL rules (as a release before them had it), so an invalid spec can be
    stored; the generated CRD is back afterwards. Each swap waits until the apiserver serves it
    (a dry-run patch of an invalid spec on TrainingJob ``probe`` accepted, then refused again)."""
    client = tj.custom.api_client
    body = yaml.safe_load(crd.CRD_PATHS[0].read_text())
    install_crd(client, _without_rules(copy.deepcopy(body)))
    try:
        wait_for("the CRD without rules served", lambda: _accepted(tj, probe, _PROBE))
        yield
    finally:
        install_crd(client)
        wait_for("the CRD with its rules served", lambda: not _accepted(tj, probe, _PROBE))


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
    # min above max: refused by today's CRD (CEL), so stored through a CRD without the rules, as
    # an object edited before an upgrade would be. The operator's models refuse it.
    invalid = {"gracePeriod": {"initialSeconds": 30, "min": 100, "max": 50}}
    assert not _accepted(tj, name, invalid)
    with crd_without_rules(tj, name):
        tj.patch_spec(name, invalid)
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
    # The invalid spec stays stored (the apiserver ratchets unchanged fields) and the status
    # writes of the operator went through all along.
    assert tj.get(name)["spec"]["gracePeriod"]["min"] == 100


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
