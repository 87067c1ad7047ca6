"""Fixtures of the operator tier (the control plane fixtures come from tests/cluster)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from preemptible_operator import rbac
from tests.cluster.controlplane import ControlPlane
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    delete_training_jobs,
    free_port,
    install_crd,
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
def least_privilege_operator(
    control_plane: ControlPlane,
    tj_crd: None,
    namespace: str,
    checkpoint_root: Path,
    tmp_path: Path,
) -> Iterator[OperatorProcess]:
    """The operator as a ServiceAccount bound to exactly preemptible_operator.rbac's rules."""
    role_name = f"preemptible-operator-{uuid.uuid4().hex[:6]}"
    with control_plane.api_client() as client:
        core = kubernetes.client.CoreV1Api(client)
        authz = kubernetes.client.RbacAuthorizationV1Api(client)
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
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "operator")
    op = OperatorProcess(kubeconfig, namespace, checkpoint_root, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        with control_plane.api_client() as client:
            delete_training_jobs(client, namespace, op)
        op.kill()
        with control_plane.api_client() as client:
            authz = kubernetes.client.RbacAuthorizationV1Api(client)
            authz.delete_cluster_role_binding(role_name)
            authz.delete_cluster_role(role_name)
