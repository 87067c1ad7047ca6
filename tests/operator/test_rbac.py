"""The operator runs with exactly the RBAC rules it documents (preemptible_operator.rbac), as a
ServiceAccount held to its admission policy: a preemption and a requeue work, and nothing it does
is forbidden; the policy refuses it anything else. Users bound to the built-in edit/view roles
get TrainingJob access through the aggregated roles."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.exceptions import ApiException

from preemptible_operator import models, rbac, render
from preemptible_operator.classify import DEACTIVATED_BY_OPERATOR_ANNOTATION
from preemptible_operator.reconcile import Reconciler
from preemptible_operator.victims import BOOST_ANNOTATION
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubeconfig import api_client_from
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import (
    OperatorProcess,
    TJClient,
    install_crd,
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


def _forbidden(call: Callable[[], object], *needles: str) -> None:
    """``call`` is refused by the operator's admission policy (not by RBAC), with one of
    ``needles`` in the message: where two policies both refuse, the apiserver reports whichever
    it evaluated first, and that order is not fixed."""
    with pytest.raises(ApiException) as info:
        call()
    assert info.value.status == 403, info.value.body
    assert any(n in str(info.value.body) for n in needles), info.value.body


def _json(resp: Any) -> dict[str, Any]:
    return json.loads(resp.data)


def test_admission_policy_holds_the_operator_to_its_own_writes(
    control_plane: ControlPlane, namespace: str, operator_identity: Path, checkpoint_root: Path
) -> None:
    """As the operator's ServiceAccount (its own token, RBAC as documented): the operator's
    finalizer release and pod stop pass; a label change, a foreign finalizer's removal, an
    unlabelled pod's delete and Jobs of no TrainingJob are refused."""
    other = "example.com/keep"
    gate = [{"name": "preemptible.dev/test-hold"}]  # never scheduled: nothing runs
    container = {"name": "c", "image": "none"}
    with control_plane.api_client() as admin, api_client_from(operator_identity) as sa:
        core, batch = kubernetes.client.CoreV1Api(admin), kubernetes.client.BatchV1Api(admin)
        sa_core, sa_batch = kubernetes.client.CoreV1Api(sa), kubernetes.client.BatchV1Api(sa)
        tj = TJClient(admin, namespace).create(toy_training_job("owner", checkpoint_root))
        labels = {render.LABEL_TRAINING_JOB: "owner", render.LABEL_ATTEMPT: "1"}
        core.create_namespaced_pod(
            namespace,
            {
                "metadata": {
                    "name": "ours",
                    "labels": labels,
                    "finalizers": [render.ATTEMPT_FINALIZER, other],
                },
                "spec": {"schedulingGates": gate, "containers": [container]},
            },
        )
        core.create_namespaced_pod(
            namespace,
            {
                "metadata": {"name": "foreign"},
                "spec": {"schedulingGates": gate, "containers": [container]},
            },
        )
        only_finalizer = "may only remove its finalizer"
        # A label change, alone or along with the finalizer's removal.
        _forbidden(
            lambda: sa_core.patch_namespaced_pod(
                "ours", namespace, {"metadata": {"labels": {"x": "y"}}}
            ),
            only_finalizer,
        )
        _forbidden(
            lambda: sa_core.patch_namespaced_pod(
                "ours",
                namespace,
                [
                    {"op": "remove", "path": "/metadata/finalizers/0"},
                    {"op": "add", "path": "/metadata/labels/x", "value": "y"},
                ],
            ),
            only_finalizer,
        )
        # Someone else's finalizer.
        _forbidden(
            lambda: sa_core.patch_namespaced_pod(
                "ours", namespace, [{"op": "remove", "path": "/metadata/finalizers/1"}]
            ),
            only_finalizer,
        )
        # The operator's own release (its JSON patch, test + remove by index) passes.
        reconciler = Reconciler(sa)
        pod = _json(core.read_namespaced_pod("ours", namespace, _preload_content=False))
        assert reconciler._release_pods([pod]) == 0
        assert core.read_namespaced_pod("ours", namespace).metadata.finalizers == [other]
        # Deletes: never an unlabelled pod; a training pod (suspend's graceful stop) passes.
        _forbidden(
            lambda: sa_core.delete_namespaced_pod("foreign", namespace),
            "may only delete pods labelled",
        )
        core.patch_namespaced_pod("ours", namespace, {"metadata": {"finalizers": None}})
        pod = _json(core.read_namespaced_pod("ours", namespace, _preload_content=False))
        reconciler._stop_pods([pod])
        wait_for(
            "pod ours deleted",
            lambda: (
                "ours" not in {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
            ),
            timeout=30,
        )
        # Jobs: only labelled and owned by a TrainingJob, created or deleted (dry run).
        # (the TrainingJob's image: the children policy refuses any other)
        image = {**container, "image": tj["spec"]["image"]}
        template = {"spec": {"restartPolicy": "Never", "containers": [image]}}
        owned = {
            "metadata": {
                "name": "owner-a9",
                "labels": labels,
                "ownerReferences": [render.owner_reference(tj["metadata"])],
            },
            "spec": {"suspend": True, "template": template},
        }
        sa_batch.create_namespaced_job(namespace, owned, dry_run="All")
        for body in (
            {**owned, "metadata": {"name": "no-owner", "labels": labels}},
            {
                **owned,
                "metadata": {**owned["metadata"], "name": "no-label", "labels": {}},
            },
        ):
            # A labelled Job without an owner is refused by the children policy as well.
            _forbidden(
                lambda body=body: sa_batch.create_namespaced_job(namespace, body, dry_run="All"),
                "may only write Jobs and Services",
                "may only create Jobs and Services",
            )
        batch.create_namespaced_job(
            namespace,
            {"metadata": {"name": "foreign"}, "spec": {"suspend": True, "template": template}},
        )
        _forbidden(
            lambda: sa_batch.delete_namespaced_job("foreign", namespace, dry_run="All"),
            "may only write Jobs and Services",
        )
        # Anyone else is not held to the policy.
        core.patch_namespaced_pod("foreign", namespace, {"metadata": {"labels": {"x": "y"}}})


def test_admission_policy_only_lets_the_operator_deactivate_workloads(
    control_plane: ControlPlane, namespace: str, operator_identity: Path
) -> None:
    """The Workload checks of the policy, on the real apiserver: the same validations bound to a
    stand-in ``workloads`` resource of a test group (Kueue itself is not needed to test them)."""
    group = f"policy{uuid.uuid4().hex[:6]}.preemptible.dev"
    crd_body = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"workloads.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "workloads", "singular": "workload", "kind": "Workload"},
            "versions": [
                {
                    "name": "v1beta1",
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }
    name = f"workloads-{uuid.uuid4().hex[:6]}"
    policy = rbac.admission_policy(name, namespace, "operator")
    policy["spec"]["matchConstraints"] = {
        "resourceRules": [
            {
                "apiGroups": [group],
                "apiVersions": ["*"],
                "resources": ["workloads"],
                "operations": ["UPDATE", "DELETE"],
            }
        ]
    }
    role = {
        "metadata": {"name": name},
        "rules": [{"apiGroups": [group], "resources": ["workloads"], "verbs": ["patch", "delete"]}],
    }
    binding = {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "operator", "namespace": namespace}],
    }
    with control_plane.api_client() as admin:
        install_crd(admin, crd_body)
        admission = kubernetes.client.AdmissionregistrationV1Api(admin)
        admission.create_validating_admission_policy(policy)
        admission.create_validating_admission_policy_binding(rbac.admission_policy_binding(name))
        authz = kubernetes.client.RbacAuthorizationV1Api(admin)
        authz.create_namespaced_role(namespace, role)
        authz.create_namespaced_role_binding(namespace, binding)
        try:
            _workload_checks(admin, operator_identity, namespace, group)
        finally:
            admission.delete_validating_admission_policy_binding(name)
            admission.delete_validating_admission_policy(name)
            kubernetes.client.ApiextensionsV1Api(admin).delete_custom_resource_definition(
                crd_body["metadata"]["name"]
            )


def _workload_checks(
    admin: kubernetes.client.ApiClient, operator_identity: Path, namespace: str, group: str
) -> None:
    batch = kubernetes.client.BatchV1Api(admin)
    job = batch.create_namespaced_job(
        namespace,
        {
            "metadata": {"name": "kueue-job-a1"},
            "spec": {
                "suspend": True,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "c", "image": "none"}],
                    }
                },
            },
        },
    )
    owner = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": "kueue-job-a1",
        "uid": job.metadata.uid,
        "controller": True,
    }
    custom = kubernetes.client.CustomObjectsApi(admin)
    args = (group, "v1beta1", namespace, "workloads")
    spec = {"queueName": "q", "active": True, "podSets": [{"name": "main", "count": 1}]}
    for wl in ("w1", "w2"):
        custom.create_namespaced_custom_object(
            *args,
            {
                "apiVersion": f"{group}/v1beta1",
                "kind": "Workload",
                "metadata": {"name": wl, "ownerReferences": [owner]},
                "spec": spec,
            },
        )
    only = "may only deactivate"
    with api_client_from(operator_identity) as sa:
        sa_custom = kubernetes.client.CustomObjectsApi(sa)

        def refused_patch(body: dict[str, Any]) -> None:
            _forbidden(lambda: sa_custom.patch_namespaced_custom_object(*args, "w1", body), only)

        refused_patch({"spec": {"queueName": "other"}})
        refused_patch({"spec": {"active": False, "queueName": "other"}})
        refused_patch({"spec": {"active": False}, "metadata": {"labels": {"x": "y"}}})
        refused_patch({"metadata": {"annotations": {"x": "y"}}})  # not one of its two
        _forbidden(lambda: sa_custom.delete_namespaced_custom_object(*args, "w2"), only)
        # What the operator sends passes: the priority boost (victims.py) while it runs, then
        # its deactivation (Reconciler._deactivate_workload: marked, the boost dropped).
        mark = {DEACTIVATED_BY_OPERATOR_ANNOTATION: "true", BOOST_ANNOTATION: None}
        sa_custom.patch_namespaced_custom_object(
            *args, "w1", {"metadata": {"annotations": {BOOST_ANNOTATION: "40"}}}
        )
        sa_custom.patch_namespaced_custom_object(
            *args, "w1", {"spec": {"active": False}, "metadata": {"annotations": mark}}
        )
        refused_patch({"spec": {"active": True}})  # never reactivated
    stored = custom.get_namespaced_custom_object(*args, "w1")
    assert stored["spec"] == {**spec, "active": False}
    assert stored["metadata"]["annotations"] == {DEACTIVATED_BY_OPERATOR_ANNOTATION: "true"}


def test_edit_and_view_include_training_jobs(
    control_plane: ControlPlane, namespace: str, tj_crd: None, checkpoint_root: Path
) -> None:
    """The user roles aggregate into the built-in edit and view ClusterRoles (the control plane
    runs kube-controller-manager's clusterrole-aggregation controller): a user bound to edit in
    a namespace creates a TrainingJob; one bound to view lists them but cannot create one."""
    prefix = f"preemptible-{uuid.uuid4().hex[:6]}"
    roles = rbac.user_roles(prefix)
    with control_plane.api_client() as admin:
        authz = kubernetes.client.RbacAuthorizationV1Api(admin)
        for role in roles:
            authz.create_cluster_role(role)
        try:

            def aggregated(builtin: str, verb: str) -> bool:
                return any(
                    models.PLURAL in (r.resources or []) and verb in r.verbs
                    for r in authz.read_cluster_role(builtin).rules or []
                )

            wait_for("edit aggregated", lambda: aggregated("edit", "create"), timeout=60)
            wait_for("admin aggregated", lambda: aggregated("admin", "create"), timeout=60)
            wait_for("view aggregated", lambda: aggregated("view", "list"), timeout=60)
            users = {}
            for builtin in ("edit", "view"):
                user = f"{prefix}-{builtin}-user"
                authz.create_namespaced_role_binding(
                    namespace,
                    {
                        "metadata": {"name": user},
                        "roleRef": {
                            "apiGroup": "rbac.authorization.k8s.io",
                            "kind": "ClusterRole",
                            "name": builtin,
                        },
                        "subjects": [
                            {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}
                        ],
                    },
                )
                users[builtin] = control_plane.client_kubeconfig(user)
            with api_client_from(users["edit"]) as editor, api_client_from(users["view"]) as viewer:
                TJClient(editor, namespace).create(toy_training_job("by-editor", checkpoint_root))
                TJClient(editor, namespace).patch_spec("by-editor", {"maxRestarts": 2})
                as_viewer = TJClient(viewer, namespace)
                assert as_viewer.get("by-editor")["metadata"]["name"] == "by-editor"
                custom = kubernetes.client.CustomObjectsApi(viewer)
                listed = custom.list_namespaced_custom_object(
                    models.GROUP, models.VERSION, namespace, models.PLURAL
                )
                assert [i["metadata"]["name"] for i in listed["items"]] == ["by-editor"]
                with pytest.raises(ApiException) as info:
                    as_viewer.create(toy_training_job("by-viewer", checkpoint_root))
                assert info.value.status == 403
        finally:
            for role in roles:
                authz.delete_cluster_role(role["metadata"]["name"])
