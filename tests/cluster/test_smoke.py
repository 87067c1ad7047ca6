"""Smoke tests proving the cluster tier is real: API validation, the Job controller and scheduler
with the node agent, RBAC, and Kueue admission and preemption with a graceful SIGTERM."""

from __future__ import annotations

import ipaddress
import signal
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from trainer_runtime.protocol import EXIT_PREEMPTED

from .controlplane import ControlPlane
from .helpers import condition, eventually, job_manifest, python_container, wait_for_job_condition
from .kubeconfig import api_client_from
from .kueue import Kueue
from .node_agent import NodeAgent

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RBAC_GROUP = "rbac.authorization.k8s.io"


def test_crd_schema_rejects_invalid_object(control_plane: ControlPlane, namespace: str) -> None:
    group = f"smoke{uuid.uuid4().hex[:6]}.preemptible.dev"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "required": ["size"],
                                    "properties": {"size": {"type": "integer", "minimum": 1}},
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    with control_plane.api_client() as client:
        ext = kubernetes.client.ApiextensionsV1Api(client)
        custom = kubernetes.client.CustomObjectsApi(client)
        ext.create_custom_resource_definition(crd)
        try:

            def established() -> bool:
                obj = client.sanitize_for_serialization(
                    ext.read_custom_resource_definition(f"widgets.{group}")
                )
                cond = condition(obj, "Established")
                return bool(cond and cond["status"] == "True")

            eventually("CRD established", established, timeout=60)

            def widget(name: str, spec: dict[str, Any]) -> dict[str, Any]:
                return {"apiVersion": f"{group}/v1", "kind": "Widget",
                        "metadata": {"name": name}, "spec": spec}  # fmt: skip

            # The discovery/storage for a new CRD can lag Established by a moment.
            created = eventually(
                "valid Widget accepted",
                lambda: _create_or_none(custom, group, namespace, widget("ok", {"size": 3})),
                timeout=60,
            )
            assert created["spec"]["size"] == 3
            for bad, field in (
                ({"size": 0}, "spec.size"),
                ({}, "spec.size"),
                ({"size": "x"}, "spec.size"),
            ):
                with pytest.raises(ApiException) as info:
                    custom.create_namespaced_custom_object(
                        group, "v1", namespace, "widgets", widget("bad", bad)
                    )
                assert info.value.status == 422, info.value.body
                assert field in info.value.body
        finally:
            ext.delete_custom_resource_definition(f"widgets.{group}")


def _create_or_none(
    custom: kubernetes.client.CustomObjectsApi, group: str, namespace: str, body: dict[str, Any]
) -> dict[str, Any] | None:
    try:
        return custom.create_namespaced_custom_object(group, "v1", namespace, "widgets", body)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


INDEX_CODE = """
import os, pathlib, sys
index = os.environ["JOB_COMPLETION_INDEX"]
line = os.environ["POD_IP"] + " " + os.environ["POD_NAME"]
pathlib.Path(sys.argv[1], "index-" + index).write_text(line)
"""


def test_indexed_job_runs_through_node_agent(
    control_plane: ControlPlane, node_agent: NodeAgent, namespace: str, tmp_path: Path
) -> None:
    container = python_container(INDEX_CODE, "/out", mounts={"out": "/out"})
    container["env"] += [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    job = job_manifest(
        "indexed",
        [container],
        completions=3,
        parallelism=3,
        indexed=True,
        volumes=[{"name": "out", "hostPath": {"path": str(tmp_path), "type": "Directory"}}],
    )
    with control_plane.api_client() as client:
        kubernetes.client.BatchV1Api(client).create_namespaced_job(namespace, job)
        done = wait_for_job_condition(client, namespace, "indexed", "Complete", timeout=180)
    assert done["status"]["succeeded"] == 3
    lines = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert sorted(lines) == ["index-0", "index-1", "index-2"]
    ips = {ip for ip, _ in lines.values()}
    # Each pod has its own address: in the pod subnet (network namespaces) or loopback.
    assert len(ips) == 3
    if node_agent.network is not None:
        assert all(ipaddress.ip_address(ip) in node_agent.network.subnet for ip in ips), ips
    else:
        assert all(ip.startswith("127.") for ip in ips), ips
    for index, (_, pod_name) in lines.items():
        record = node_agent.record(namespace, pod_name)
        assert record is not None, f"{index}: pod {pod_name} was not run by the node agent"
        assert record.phase == "Succeeded"


def test_restricted_identity_is_refused_what_rbac_does_not_allow(
    control_plane: ControlPlane, namespace: str
) -> None:
    user = control_plane.restricted_user
    with control_plane.restricted_api_client(user) as restricted:
        core = kubernetes.client.CoreV1Api(restricted)
        with pytest.raises(ApiException) as before:
            core.list_namespaced_pod(namespace)
        assert before.value.status == 403

        with control_plane.api_client() as admin:
            rbac = kubernetes.client.RbacAuthorizationV1Api(admin)
            rbac.create_namespaced_role(
                namespace,
                {
                    "metadata": {"name": "pod-reader"},
                    "rules": [
                        {
                            "apiGroups": [""],
                            "resources": ["pods"],
                            "verbs": ["get", "list", "watch"],
                        }
                    ],
                },
            )
            rbac.create_namespaced_role_binding(
                namespace,
                {
                    "metadata": {"name": "pod-reader"},
                    "roleRef": {"apiGroup": RBAC_GROUP, "kind": "Role", "name": "pod-reader"},
                    "subjects": [{"apiGroup": RBAC_GROUP, "kind": "User", "name": user}],
                },
            )

        def allowed() -> bool:
            try:
                core.list_namespaced_pod(namespace)
            except ApiException as exc:
                if exc.status == 403:
                    return False
                raise
            return True

        eventually("RoleBinding to take effect", allowed, timeout=60)
        refused = [
            lambda: core.create_namespaced_pod(
                namespace,
                {"metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
            ),
            lambda: core.list_namespaced_pod("default"),
            lambda: core.list_node(),
            lambda: core.list_namespaced_secret(namespace),
            lambda: core.delete_namespace(namespace),
        ]
        for call in refused:
            with pytest.raises(ApiException) as info:
                call()
            assert info.value.status == 403
    if control_plane.binaries.kubectl is not None:
        kubeconfig = control_plane.restricted_kubeconfig(user)
        can_list = control_plane.kubectl("auth", "can-i", "list", "pods", "-n", namespace,
                                         kubeconfig=kubeconfig, check=False)  # fmt: skip
        can_create = control_plane.kubectl("auth", "can-i", "create", "pods", "-n", namespace,
                                           kubeconfig=kubeconfig, check=False)  # fmt: skip
        assert (can_list.returncode, can_list.stdout.strip()) == (0, "yes")
        assert (can_create.returncode, can_create.stdout.strip()) == (1, "no")


# The victim traps SIGTERM, proves it ran (file), takes its time (as a checkpoint would) and exits
# with the preemption code by itself, well within its grace period.
VICTIM_CODE = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[1])
def on_sigterm(signum, frame):
    (out / "sigterm").write_text(str(time.time()))
    time.sleep(2.0)
    (out / "saved").write_text("checkpoint")
    sys.exit(int(sys.argv[2]))
signal.signal(signal.SIGTERM, on_sigterm)
(out / "ready").write_text("ready")
while True:
    time.sleep(0.1)
"""


@pytest.mark.kueue
def test_kueue_preempts_lower_priority_job_with_graceful_sigterm(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Kueue,
    kueue_namespace: str,
    tmp_path: Path,
) -> None:
    namespace = kueue_namespace
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    quota_cpu = kueue.quota["cpu"]
    victim = job_manifest(
        "victim",
        [
            python_container(
                VICTIM_CODE, "/out", str(EXIT_PREEMPTED), cpu=quota_cpu, mounts={"out": "/out"}
            )
        ],
        labels=kueue.job_labels(kueue.low_priority),
        suspend=True,
        grace_seconds=30,
        volumes=[{"name": "out", "hostPath": {"path": str(victim_dir)}}],
    )
    preemptor = job_manifest(
        "preemptor",
        [python_container("print('preemptor ran')", cpu=quota_cpu)],
        labels=kueue.job_labels(kueue.high_priority),
        suspend=True,
    )
    with control_plane.api_client() as client:
        batch = kubernetes.client.BatchV1Api(client)
        victim_uid = batch.create_namespaced_job(namespace, victim).metadata.uid
        eventually("victim admitted and running", (victim_dir / "ready").exists, timeout=180)
        victim_pods = [r for r in node_agent.records() if r.namespace == namespace]
        assert len(victim_pods) == 1
        victim_pod = victim_pods[0]

        batch.create_namespaced_job(namespace, preemptor)
        seen_eviction: list[dict[str, Any]] = []

        def preemptor_done() -> bool:
            workload = kueue.workload_for_job(namespace, victim_uid)
            for kind in ("Evicted", "Preempted"):
                cond = condition(workload or {}, kind)
                if cond and cond["status"] == "True":
                    seen_eviction.append(dict(cond))
            job = client.sanitize_for_serialization(
                batch.read_namespaced_job("preemptor", namespace)
            )
            cond = condition(job, "Complete")
            return bool(cond and cond["status"] == "True")

        eventually("preemptor Job complete", preemptor_done, timeout=240, interval=0.5)
        # Stop the victim from being admitted again now that the quota is free.
        batch.delete_namespaced_job(
            namespace=namespace, name="victim", propagation_policy="Background"
        )

    assert any(c["reason"] == "Preempted" or c["type"] == "Preempted" for c in seen_eviction), (
        seen_eviction
    )
    assert victim_pod.done.wait(60)
    run = victim_pod.last_run()
    assert run is not None and run.exit is not None
    assert run.sigterm_at is not None, "the victim never got SIGTERM"
    assert (victim_dir / "sigterm").exists() and (victim_dir / "saved").exists()
    assert not run.killed and run.exit.signal != signal.SIGKILL
    assert run.exit.exit_code == EXIT_PREEMPTED
    assert victim_pod.grace_seconds == 30
    # It took its 2 s after SIGTERM: the agent waited instead of killing it.
    assert run.seconds_after_sigterm is not None and run.seconds_after_sigterm >= 2.0
    assert victim_pod.phase == "Failed"


def test_service_account_identity_has_only_its_rbac(
    control_plane: ControlPlane, namespace: str
) -> None:
    with control_plane.api_client() as admin:
        kubernetes.client.CoreV1Api(admin).create_namespaced_service_account(
            namespace, {"metadata": {"name": "operator"}}
        )
    kubeconfig = control_plane.service_account_kubeconfig(namespace, "operator")
    with api_client_from(kubeconfig) as client:
        review = kubernetes.client.AuthenticationV1Api(client).create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        )
        assert review.status.user_info.username == f"system:serviceaccount:{namespace}:operator"
        with pytest.raises(ApiException) as info:
            kubernetes.client.CoreV1Api(client).list_namespaced_pod(namespace)
        assert info.value.status == 403
