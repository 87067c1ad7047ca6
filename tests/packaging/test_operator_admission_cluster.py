"""A stolen operator token, on the real control plane (tests/cluster): a ServiceAccount holding
exactly the grants and admission policies of the chart (rendered with `helm template` as an
install does, default values: the cluster-wide mode) is refused each attack of issue 39 and
allowed each write the operator itself makes. Only admission is exercised: creates are dry runs,
Jobs are suspended, no pod runs (seconds)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from preemptible_operator import models, render
from preemptible_operator.classify import DEACTIVATED_BY_OPERATOR_ANNOTATION
from preemptible_operator.victims import BOOST_ANNOTATION
from tests.cluster.controlplane import ControlPlane
from tests.cluster.kubeconfig import api_client_from
from tests.operator.harness import install_crd, wait_for
from tests.packaging.chart import find_objects, is_user_role
from tests.packaging.chart import render as render_chart
from tests.packaging.tools import require_tool

pytestmark = [pytest.mark.cluster]

KUEUE_GROUP = "kueue.x-k8s.io"
# Kueue's own Workload CRD is converted by Kueue's webhook (only served while Kueue runs): the
# chart's rules and policies are applied with Kueue's group swapped for this stand-in's.
WORKLOAD_VERSION = "v1beta1"
TJ_ARGS = (models.GROUP, models.VERSION)
# A validation that fails: 403 Forbidden; no TrainingJob to check against (no params): 422.
REFUSED = (403, 422)
GATE = [{"name": "preemptible.dev/test-hold"}]

# The TrainingJob of the tenant namespace: it asks for a service account, a credentials Secret,
# an env Secret, a claim, a hostPath and shared memory.
TJ_SPEC: dict[str, Any] = {
    "image": "registry.example/train:1",
    "command": ["python", "train.py"],
    "shmSize": "1Gi",
    "checkpoint": {"uri": "s3://bucket/run", "credentialsSecret": "s3-creds"},
    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
        {"name": "scratch", "hostPath": {"path": "/mnt/scratch", "type": "DirectoryOrCreate"}},
    ],
    "volumeMounts": [
        {"name": "data", "mountPath": "/data"},
        {"name": "scratch", "mountPath": "/scratch"},
    ],
    "podTemplate": {"spec": {"serviceAccountName": "trainer"}},
}


@dataclass
class Setup:
    operator: Path  # kubeconfig of the chart's ServiceAccount
    tenant: str  # holds TrainingJob "tj"
    empty: str  # holds no TrainingJob
    tj: dict[str, Any]  # as stored
    group: str  # the stand-in Workload group


def _swap_group(obj: dict[str, Any], group: str) -> None:
    """Kueue's group -> the stand-in's, in every apiGroups list of ``obj``."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "apiGroups" and isinstance(value, list):
                obj[key] = [group if g == KUEUE_GROUP else g for g in value]
            else:
                _swap_group(value, group)
    elif isinstance(obj, list):
        for item in obj:
            _swap_group(item, group)


def _workload_crd(group: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"workloads.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "workloads", "singular": "workload", "kind": "Workload"},
            "versions": [
                {
                    "name": WORKLOAD_VERSION,
                    "served": True,
                    "storage": True,
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


_GRANTS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def _probe_refused(client: kubernetes.client.ApiClient, namespace: str) -> bool:
    """The policies are loaded (the apiserver loads them asynchronously): a Job in a namespace
    without TrainingJob is refused."""
    body = {
        "metadata": {"generateName": "probe-"},
        "spec": {
            "suspend": True,
            "template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}
            },
        },
    }
    try:
        kubernetes.client.BatchV1Api(client).create_namespaced_job(namespace, body, dry_run="All")
    except ApiException as exc:
        if exc.status in REFUSED and "ValidatingAdmissionPolicy" in str(exc.body):
            return True
        raise
    return False


@pytest.fixture(scope="module")
def setup(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    helm = require_tool("helm")
    suffix = uuid.uuid4().hex[:6]
    release, system = f"adm{suffix}", f"adm-system-{suffix}"
    tenant, empty = f"adm-tenant-{suffix}", f"adm-empty-{suffix}"
    group = f"adm{suffix}.preemptible.dev"
    objects = render_chart(
        helm, {}, release=release, namespace=system, tmp_path=tmp_path_factory.mktemp("values")
    )
    grants = [o for o in objects if o["kind"] in _GRANTS and not is_user_role(o)]
    assert len(find_objects(grants, "ValidatingAdmissionPolicy")) >= 1
    _swap_group(grants, group)
    with control_plane.api_client() as admin:
        install_crd(admin)
        install_crd(admin, _workload_crd(group))
        core = kubernetes.client.CoreV1Api(admin)
        for ns in (system, tenant, empty):
            core.create_namespace({"metadata": {"name": ns}})
        tj = kubernetes.client.CustomObjectsApi(admin).create_namespaced_custom_object(
            *TJ_ARGS,
            tenant,
            models.PLURAL,
            {
                "apiVersion": models.API_VERSION,
                "kind": models.KIND,
                "metadata": {"name": "tj"},
                "spec": TJ_SPEC,
            },
        )
    proc = control_plane.kubectl(
        "apply", "-f", "-", input=yaml.safe_dump_all(grants), check=False, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sa,) = find_objects(grants, "ServiceAccount")
    kubeconfig = control_plane.service_account_kubeconfig(system, sa["metadata"]["name"])
    try:
        with api_client_from(kubeconfig) as client:
            wait_for("the operator's policies in force", lambda: _probe_refused(client, empty))
        yield Setup(kubeconfig, tenant, empty, tj, group)
    finally:
        control_plane.kubectl(
            "delete", "--ignore-not-found", "--wait=false", "-f", "-",
            input=yaml.safe_dump_all(grants), check=False,
        )  # fmt: skip
        with control_plane.api_client() as admin:
            for ns in (system, tenant, empty):
                kubernetes.client.CoreV1Api(admin).delete_namespace(ns)
            kubernetes.client.ApiextensionsV1Api(admin).delete_custom_resource_definition(
                f"workloads.{group}"
            )


def _refused(call: Callable[[], object]) -> str:
    """``call`` is refused by admission (naming a ValidatingAdmissionPolicy); the message."""
    with pytest.raises(ApiException) as info:
        call()
    assert info.value.status in REFUSED, info.value.body
    assert "ValidatingAdmissionPolicy" in str(info.value.body), info.value.body
    return str(info.value.body)


def _attempt_job(tj: dict[str, Any], attempt: int = 1) -> dict[str, Any]:
    """The Job the operator renders for ``tj`` (render.render_job), suspended."""
    spec = models.TrainingJobSpec.model_validate(tj["spec"])
    params = render.AttemptParams(
        attempt=attempt, grace_seconds=30, resume_from="latest", suspended=True
    )
    return render.render_job(tj["metadata"], spec, params)


# ------------------------------------------------------------------ what the operator does


def test_the_operators_own_writes_pass(setup: Setup, control_plane: ControlPlane) -> None:
    """The rendered attempt Job and Service, spec.suspend, kopf's finalizer and annotation, the
    status, the priority boost and the deactivation of its attempt's Workload, the delete of a
    finished TrainingJob past its TTL: all allowed to the chart's ServiceAccount."""
    ns = setup.tenant
    with api_client_from(setup.operator) as sa, control_plane.api_client() as admin:
        batch, core = kubernetes.client.BatchV1Api(sa), kubernetes.client.CoreV1Api(sa)
        custom = kubernetes.client.CustomObjectsApi(sa)
        batch.create_namespaced_job(ns, _attempt_job(setup.tj), dry_run="All")
        batch.create_namespaced_job(ns, _attempt_job(setup.tj, 7), dry_run="All")
        service = render.render_service(
            setup.tj["metadata"], models.TrainingJobSpec.model_validate(setup.tj["spec"])
        )
        core.create_namespaced_service(ns, service, dry_run="All")
        # The TrainingJob: kopf's finalizer and bookkeeping, then spec.suspend (reconcile.py).
        custom.patch_namespaced_custom_object(
            *TJ_ARGS,
            ns,
            models.PLURAL,
            "tj",
            {
                "metadata": {
                    "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"],
                    "annotations": {"kopf.zalando.org/last-handled-configuration": "{}"},
                }
            },
        )
        custom.patch_namespaced_custom_object(
            *TJ_ARGS, ns, models.PLURAL, "tj", {"spec": {"suspend": True}}, dry_run="All"
        )
        stored = custom.get_namespaced_custom_object(*TJ_ARGS, ns, models.PLURAL, "tj")
        stored["status"] = {"phase": "Running"}
        custom.replace_namespaced_custom_object_status(
            *TJ_ARGS, ns, models.PLURAL, "tj", stored, dry_run="All"
        )
        # The attempt's Workload: boost within [0, operator.priorityBoost.max], deactivation.
        _workload(admin, setup, "tj-a1", "wl-a1")
        wl = (setup.group, WORKLOAD_VERSION, ns, "workloads", "wl-a1")
        custom.patch_namespaced_custom_object(
            *wl, {"metadata": {"annotations": {BOOST_ANNOTATION: "100"}}}
        )
        mark = {DEACTIVATED_BY_OPERATOR_ANNOTATION: "true", BOOST_ANNOTATION: None}
        custom.patch_namespaced_custom_object(
            *wl, {"spec": {"active": False}, "metadata": {"annotations": mark}}
        )
        # A finished TrainingJob past its TTL (status written by the operator) is deleted.
        body = {
            "apiVersion": models.API_VERSION,
            "kind": models.KIND,
            "metadata": {"name": "done"},
            "spec": {**TJ_SPEC, "ttlSecondsAfterFinished": 60},
        }
        admin_custom = kubernetes.client.CustomObjectsApi(admin)
        done = admin_custom.create_namespaced_custom_object(*TJ_ARGS, ns, models.PLURAL, body)
        done["status"] = {"phase": "Succeeded"}
        admin_custom.replace_namespaced_custom_object_status(
            *TJ_ARGS, ns, models.PLURAL, "done", done
        )
        custom.delete_namespaced_custom_object(*TJ_ARGS, ns, models.PLURAL, "done")
        # Anyone else's Jobs, in a namespace without TrainingJobs too, are none of its business.
        job = {
            "metadata": {"name": "someone-elses"},
            "spec": {
                "template": {
                    "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}
                }
            },
        }
        for where in (setup.empty, ns):
            kubernetes.client.BatchV1Api(admin).create_namespaced_job(where, job, dry_run="All")


def _workload(
    admin: kubernetes.client.ApiClient, setup: Setup, job: str, name: str
) -> dict[str, Any]:
    """A suspended Job ``job`` (no pod) and a Workload owned by it, as Kueue creates them."""
    ns = setup.tenant
    created = kubernetes.client.BatchV1Api(admin).create_namespaced_job(
        ns,
        {
            "metadata": {"name": job},
            "spec": {
                "suspend": True,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "schedulingGates": GATE,
                        "containers": [{"name": "c", "image": "x"}],
                    }
                },
            },
        },
    )
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": created.metadata.uid}
    return kubernetes.client.CustomObjectsApi(admin).create_namespaced_custom_object(
        setup.group,
        WORKLOAD_VERSION,
        ns,
        "workloads",
        {
            "apiVersion": f"{setup.group}/{WORKLOAD_VERSION}",
            "kind": "Workload",
            "metadata": {"name": name, "ownerReferences": [owner]},
            "spec": {"active": True, "queueName": "q", "podSets": [{"name": "m", "count": 1}]},
        },
    )


# ------------------------------------------------------------------- what a stolen token does


def _with_template(job: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict:
    change(job["spec"]["template"]["spec"])
    return job


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == render.CONTAINER_NAME)


JOB_ATTACKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "another service account": lambda pod: pod.update(serviceAccountName="cluster-admin-sa"),
    "a Secret the TrainingJob did not name (volume)": lambda pod: pod["volumes"].append(
        {"name": "loot", "secret": {"secretName": "other-team-creds"}}
    ),
    "a Secret the TrainingJob did not name (envFrom)": lambda pod: _trainer(pod)["envFrom"].append(
        {"secretRef": {"name": "other-team-creds"}}
    ),
    "a Secret the TrainingJob did not name (env)": lambda pod: _trainer(pod)["env"].append(
        {"name": "X", "valueFrom": {"secretKeyRef": {"name": "other-team-creds", "key": "k"}}}
    ),
    "another claim": lambda pod: pod["volumes"].append(
        {"name": "db", "persistentVolumeClaim": {"claimName": "database"}}
    ),
    "another hostPath": lambda pod: next(v for v in pod["volumes"] if v["name"] == "scratch")[
        "hostPath"
    ].update(path="/"),
    "a hostPath of a new name": lambda pod: pod["volumes"].append(
        {"name": "data2", "hostPath": {"path": "/var/run"}}
    ),
    "the host network": lambda pod: pod.update(hostNetwork=True, hostPID=True),
    "a privileged container": lambda pod: _trainer(pod)["securityContext"].update(
        privileged=True, allowPrivilegeEscalation=True
    ),
    "another image": lambda pod: _trainer(pod).update(image="attacker.example/exfil:1"),
    "a sidecar of another image": lambda pod: pod["containers"].append(
        {
            "name": "side",
            "image": "attacker.example/exfil:1",
            "envFrom": [{"secretRef": {"name": "s3-creds"}}],
        }
    ),
}


@pytest.mark.parametrize("attack", list(JOB_ATTACKS))
def test_a_job_of_the_training_job_runs_only_what_it_asks_for(setup: Setup, attack: str) -> None:
    """The rendered Job with one change the TrainingJob did not ask for: refused."""
    job = _with_template(_attempt_job(setup.tj), JOB_ATTACKS[attack])
    with api_client_from(setup.operator) as sa:
        batch = kubernetes.client.BatchV1Api(sa)
        _refused(lambda: batch.create_namespaced_job(setup.tenant, job, dry_run="All"))


@pytest.mark.parametrize("where", ["kube-system", "empty"])
def test_no_job_or_service_outside_namespaces_with_training_jobs(setup: Setup, where: str) -> None:
    """The Job and Service the operator would render, labelled and owned as its own, in
    kube-system or a namespace without TrainingJobs (run as any of its service accounts)."""
    ns = setup.empty if where == "empty" else "kube-system"
    tj = {**setup.tj, "metadata": {**setup.tj["metadata"], "namespace": ns}}
    job = _with_template(_attempt_job(tj), lambda pod: pod.update(serviceAccountName="default"))
    spec = models.TrainingJobSpec.model_validate(tj["spec"])
    with api_client_from(setup.operator) as sa:
        batch, core = kubernetes.client.BatchV1Api(sa), kubernetes.client.CoreV1Api(sa)
        _refused(lambda: batch.create_namespaced_job(ns, job, dry_run="All"))
        service = render.render_service(tj["metadata"], spec)
        _refused(lambda: core.create_namespaced_service(ns, service, dry_run="All"))


def test_a_job_naming_a_forged_owner_uid_is_refused(setup: Setup) -> None:
    meta = {**setup.tj["metadata"], "uid": str(uuid.uuid4())}
    job = _attempt_job({**setup.tj, "metadata": meta})
    with api_client_from(setup.operator) as sa:
        batch = kubernetes.client.BatchV1Api(sa)
        _refused(lambda: batch.create_namespaced_job(setup.tenant, job, dry_run="All"))


def test_the_service_stays_headless(setup: Setup) -> None:
    spec = models.TrainingJobSpec.model_validate(setup.tj["spec"])
    service = render.render_service(setup.tj["metadata"], spec)
    service["spec"] = {**service["spec"], "clusterIP": None, "type": "LoadBalancer"}
    with api_client_from(setup.operator) as sa:
        core = kubernetes.client.CoreV1Api(sa)
        _refused(lambda: core.create_namespaced_service(setup.tenant, service, dry_run="All"))


def test_priority_boost_only_on_attempt_workloads_within_the_band(
    setup: Setup, control_plane: ControlPlane
) -> None:
    """The boost annotation on the Workload of a Job that is no attempt, and above
    operator.priorityBoost.max (or not a number) on an attempt's: refused."""
    with control_plane.api_client() as admin:
        _workload(admin, setup, "web", "wl-web")
        _workload(admin, setup, "tj-a2", "wl-a2")
    args = (setup.group, WORKLOAD_VERSION, setup.tenant, "workloads")
    with api_client_from(setup.operator) as sa:
        custom = kubernetes.client.CustomObjectsApi(sa)

        def boost(name: str, value: str) -> Callable[[], object]:
            body = {"metadata": {"annotations": {BOOST_ANNOTATION: value}}}
            return lambda: custom.patch_namespaced_custom_object(*args, name, body)

        _refused(boost("wl-web", "1"))
        _refused(lambda: custom.patch_namespaced_custom_object(
            *args, "wl-web", {"spec": {"active": False}}
        ))  # fmt: skip
        for value in ("101", "1000000", "-5", "1e9"):
            _refused(boost("wl-a2", value))


TJ_ATTACKS: dict[str, dict[str, Any]] = {
    "image": {"spec": {"image": "attacker.example/exfil:1"}},
    "command": {"spec": {"command": ["sh", "-c", "env"]}},
    "service account": {"spec": {"podTemplate": {"spec": {"serviceAccountName": "admin"}}}},
    "suspend and image at once": {"spec": {"suspend": True, "image": "attacker.example/x:1"}},
    "labels": {"metadata": {"labels": {"team": "other"}}},
}


@pytest.mark.parametrize("attack", list(TJ_ATTACKS))
def test_training_job_spec_changes_beyond_suspend_are_refused(setup: Setup, attack: str) -> None:
    with api_client_from(setup.operator) as sa:
        custom = kubernetes.client.CustomObjectsApi(sa)
        body = TJ_ATTACKS[attack]
        _refused(
            lambda: custom.patch_namespaced_custom_object(
                *TJ_ARGS, setup.tenant, models.PLURAL, "tj", body, dry_run="All"
            )
        )


def test_a_running_training_job_is_not_deleted(setup: Setup) -> None:
    with api_client_from(setup.operator) as sa:
        custom = kubernetes.client.CustomObjectsApi(sa)
        _refused(
            lambda: custom.delete_namespaced_custom_object(
                *TJ_ARGS, setup.tenant, models.PLURAL, "tj", dry_run="All"
            )
        )
