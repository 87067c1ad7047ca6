"""Fixtures of the operator tier (the control plane fixtures come from tests/cluster)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from preemptible_operator import rbac
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubeconfig import api_client_from
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    delete_training_jobs,
    free_port,
    install_crd,
    wait_for_policy,
)


@pytest.fixture(scope="session")
def tj_crd(control_plane: ControlPlane) -> None:
    with control_plane.api_client() as client:
        install_crd(client)


@pytest.fixture
def checkpoint_root(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    root.mkdir()
    return root


@pytest.fixture
def tj(control_plane: ControlPlane, tj_crd: None, namespace: str) -> Iterator[TJClient]:
    with control_plane.api_client() as client:
        yield TJClient(client, namespace)


@pytest.fixture
def operator(
    control_plane: ControlPlane,
    tj_crd: None,
    namespace: str,
    checkpoint_root: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[OperatorProcess]:
    """The operator watching the test's namespace, started; stopped (by PID) afterwards. Its
    log is printed when the test fails."""
    op = OperatorProcess(
        control_plane.kubeconfig,
        namespace,
        checkpoint_root,
        tmp_path / "operator.log",
        metrics_port=free_port(),
    )
    op.start()
    try:
        yield op
    finally:
        failed = getattr(request.node, "rep_call", None)
        if failed is not None and failed.failed:
            print(f"--- operator log ({op.log}) ---\n{op.tail(120)}")
        with control_plane.api_client() as client:
            delete_training_jobs(client, namespace, op)
        op.kill()


@pytest.fixture
def operator_identity(control_plane: ControlPlane, tj_crd: None, namespace: str) -> Iterator[Path]:
    """A kubeconfig of ServiceAccount ``<namespace>/operator`` bound to exactly
    preemptible_operator.rbac's rules and held to its admission policies (the chart's defaults);
    the policy is in force when this yields."""
    role_name = f"preemptible-operator-{uuid.uuid4().hex[:6]}"
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        authz = kubernetes.client.RbacAuthorizationV1Api(client)
        admission = kubernetes.client.AdmissionregistrationV1Api(client)
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "operator"}})
        authz.create_cluster_role(rbac.cluster_role(role_name))
        authz.create_cluster_role_binding(
            {
                "metadata": {"name": role_name},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": role_name,
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": "operator", "namespace": namespace}
                ],
            }
        )
        admission.create_validating_admission_policy(
            rbac.admission_policy(role_name, namespace, "operator")
        )
        admission.create_validating_admission_policy_binding(
            rbac.admission_policy_binding(role_name)
        )
        admission.create_validating_admission_policy(
            rbac.children_policy(f"{role_name}-children", namespace, "operator")
        )
        admission.create_validating_admission_policy_binding(
            rbac.children_policy_binding(f"{role_name}-children")
        )
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "operator")
    try:
        with api_client_from(kubeconfig) as client:
            wait_for_policy(client, namespace)
        yield kubeconfig
    finally:
        with control_plane.api_client() as client:
            authz = kubernetes.client.RbacAuthorizationV1Api(client)
            admission = kubernetes.client.AdmissionregistrationV1Api(client)
            for name in (role_name, f"{role_name}-children"):
                admission.delete_validating_admission_policy_binding(name)
                admission.delete_validating_admission_policy(name)
            authz.delete_cluster_role_binding(role_name)
            authz.delete_cluster_role(role_name)


@pytest.fixture
def least_privilege_operator(
    control_plane: ControlPlane,
    tj_crd: None,
    namespace: str,
    checkpoint_root: Path,
    tmp_path: Path,
    operator_identity: Path,
) -> Iterator[OperatorProcess]:
    """The operator as a ServiceAccount bound to exactly preemptible_operator.rbac's rules and
    held to its admission policy."""
    op = OperatorProcess(operator_identity, namespace, checkpoint_root, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        with control_plane.api_client() as client:
            delete_training_jobs(client, namespace, op)
        op.kill()
