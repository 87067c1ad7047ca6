"""The chart and the plain manifests on the real control plane (tests/cluster): the apiserver
validates every rendered object, one `kubectl apply` installs manifests/install.yaml, the RBAC
grants what docs/install.md says and nothing more, and the operator runs a full preemption
scenario authenticated as the chart's ServiceAccount (a bound token, not admin)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.cluster.controlplane import ControlPlane
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import TJClient, install_crd, toy_training_job, wait_for
from tests.packaging.chart import find_objects, render
from tests.packaging.release import (
    ChartOperator,
    helm_release,
    init_container,
    run_init_container,
)
from tests.packaging.tools import REPO_ROOT, require_tool

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

INSTALL = REPO_ROOT / "manifests" / "install.yaml"
EXAMPLES = REPO_ROOT / "manifests" / "examples"
INSTALL_NS = "preemptible-system"
INSTALL_SA = f"system:serviceaccount:{INSTALL_NS}:preemptible"
RELEASE = "e2e"


@pytest.fixture(scope="module")
def helm() -> str:
    return require_tool("helm")


@pytest.fixture(scope="module")
def tj_crd(control_plane: ControlPlane) -> None:
    with control_plane.api_client() as client:
        install_crd(client)


def _apply(cp: ControlPlane, docs: list[dict[str, Any]], *args: str, namespace: str | None = None):
    """`kubectl apply --server-side` of ``docs`` from stdin; returns the CompletedProcess."""
    cmd = ["apply", "--server-side", "--force-conflicts", "-f", "-", *args]
    if namespace:
        cmd += ["-n", namespace]
    return cp.kubectl(*cmd, input=yaml.safe_dump_all(docs), check=False, timeout=180)


def _can_i(cp: ControlPlane, user: str, verb: str, resource: str, namespace: str | None) -> bool:
    """The authorizer's answer (a SubjectAccessReview: no discovery, so CRDs need not exist)."""
    resource, _, subresource = resource.partition("/")
    plural, _, group = resource.partition(".")
    attributes = {"verb": verb, "group": group, "resource": plural}
    if subresource:
        attributes["subresource"] = subresource
    if namespace:
        attributes["namespace"] = namespace
    groups = ["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}"]
    body = {"spec": {"user": user, "groups": groups, "resourceAttributes": attributes}}
    with cp.api_client() as client:
        review = kubernetes.client.AuthorizationV1Api(client).create_subject_access_review(body)
    return bool(review.status.allowed)


# ----------------------------------------------------------------------------- plain manifests


@pytest.fixture(scope="module")
def plain_install(control_plane: ControlPlane, tj_crd: None) -> Iterator[list[dict[str, Any]]]:
    """manifests/install.yaml applied with ONE kubectl apply, Deployment scaled to 0 (operator
    pods cannot authenticate under the node agent, and a cluster-wide operator would act on the
    other tests' objects). Everything but the CRDs (shared with other tests) is removed after."""
    docs = [d for d in yaml.safe_load_all(INSTALL.read_text()) if d]
    for doc in find_objects(docs, "Deployment"):
        doc["spec"]["replicas"] = 0
    proc = _apply(control_plane, docs)
    try:
        if proc.returncode != 0:
            pytest.fail(
                f"kubectl apply -f manifests/install.yaml failed:\n{proc.stdout}{proc.stderr}"
            )
        yield docs
    finally:
        leftovers = [d for d in docs if d["kind"] != "CustomResourceDefinition"]
        control_plane.kubectl(
            "delete", "--ignore-not-found", "--wait=false", "-f", "-",
            input=yaml.safe_dump_all(leftovers), check=False,
        )  # fmt: skip
        control_plane.kubectl(
            "delete", "clusterkopfpeering", "preemptible", "--ignore-not-found", check=False
        )


def test_plain_install_is_one_apply(
    control_plane: ControlPlane, plain_install: list[dict[str, Any]]
) -> None:
    for doc in plain_install:
        kind, name = doc["kind"], doc["metadata"]["name"]
        ns = doc["metadata"].get("namespace")
        args = ["get", kind, name, "-o", "name"] + (["-n", ns] if ns else [])
        assert control_plane.kubectl(*args, check=False).returncode == 0, f"{kind}/{name} missing"
    # The init container, as the chart's ServiceAccount, creates the ClusterKopfPeering the
    # operator needs; a second run finds it.
    sa_kubeconfig = control_plane.service_account_kubeconfig(INSTALL_NS, "preemptible")
    init = init_container(plain_install)
    first = run_init_container(init, sa_kubeconfig)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "ClusterKopfPeering preemptible" in first.stdout
    again = run_init_container(init, sa_kubeconfig)
    assert again.returncode == 0 and "exists" in again.stdout, again.stdout + again.stderr
    control_plane.kubectl("get", "clusterkopfpeering", "preemptible")


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("watch", "trainingjobs.preemptible.dev", True),
        ("patch", "trainingjobs.preemptible.dev", True),
        ("update", "trainingjobs.preemptible.dev/status", True),
        ("delete", "trainingjobs.preemptible.dev", True),  # spec.ttlSecondsAfterFinished
        ("create", "jobs.batch", True),
        ("delete", "jobs.batch", True),
        ("create", "services", True),
        ("patch", "pods", True),
        ("create", "events", True),
        ("patch", "workloads.kueue.x-k8s.io", True),
        # An elastic TrainingJob's own Workload (docs/elastic.md): created, deleted on suspend
        # (the admission policy holds these writes to TrainingJob-owned Workloads).
        ("create", "workloads.kueue.x-k8s.io", True),
        ("delete", "workloads.kueue.x-k8s.io", True),
        ("get", "resourceflavors.kueue.x-k8s.io", True),
        ("patch", "clusterkopfpeerings.kopf.dev", True),
        ("get", "nodes", True),
        ("list", "priorityclasses.scheduling.k8s.io", True),
        ("list", "workloadpriorityclasses.kueue.x-k8s.io", True),
        ("watch", "customresourcedefinitions.apiextensions.k8s.io", True),
        # ... and nothing more.
        ("get", "secrets", False),
        ("list", "configmaps", False),
        ("create", "pods", False),
        ("create", "pods/eviction", False),
        ("create", "trainingjobs.preemptible.dev", False),
        ("update", "jobs.batch", False),
        ("delete", "services", False),
        ("update", "workloads.kueue.x-k8s.io", False),
        ("list", "resourceflavors.kueue.x-k8s.io", False),
        ("patch", "nodes", False),
        ("create", "customresourcedefinitions.apiextensions.k8s.io", False),
        ("create", "rolebindings.rbac.authorization.k8s.io", False),
    ],
)
def test_plain_install_rbac(
    control_plane: ControlPlane,
    plain_install: list[dict[str, Any]],
    verb: str,
    resource: str,
    allowed: bool,
) -> None:
    """What the apiserver's authorizer says for the installed ServiceAccount (in some other
    namespace: the default install serves all namespaces)."""
    cluster_scoped = resource.split(".")[0] in {
        "nodes",
        "customresourcedefinitions",
        "clusterkopfpeerings",
    }
    namespace = None if cluster_scoped else "default"
    assert _can_i(control_plane, INSTALL_SA, verb, resource, namespace) is allowed


# ------------------------------------------------------------------------------ kubectl explain


def _object_paths(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(dotted path, its properties) of every object in the schema that has named fields."""
    node = node.get("items", node)
    if node.get("properties"):
        yield path, node["properties"]
        for name, child in node["properties"].items():
            yield from _object_paths(child, f"{path}.{name}")


def test_kubectl_explain_describes_every_field(control_plane: ControlPlane, tj_crd: None) -> None:
    """What users see: for every object in the TrainingJob schema, `kubectl explain` lists each of
    its fields with the field's docstring from operator/models.py (the apiserver publishes the
    generated schema as OpenAPI v3)."""
    from preemptible_operator import crd

    schema = crd.openapi_schema()
    paths = list(_object_paths(schema["properties"]["spec"], "trainingjobs.spec"))
    paths += list(_object_paths(schema["properties"]["status"], "trainingjobs.status"))
    assert len(paths) >= 10

    def explain(*args: str) -> str | None:
        proc = control_plane.kubectl("explain", *args, check=False, timeout=60)
        return proc.stdout if proc.returncode == 0 else None

    # The apiserver publishes a new CRD's OpenAPI a moment after it is Established.
    wait_for("kubectl explain trainingjobs", lambda: explain("trainingjobs.spec"), timeout=60)
    for path, fields in paths:
        out = " ".join((explain(path) or f"kubectl explain {path} failed").split())
        for name, child in fields.items():
            # The first words of the description follow the field's name in the listing.
            words = " ".join(child["description"].split()[:5])
            assert f"{name} <" in out and words in out, f"kubectl explain {path}: {name}\n{out}"
    recursive = explain("trainingjobs", "--recursive") or ""
    assert "killWaitSeconds" in recursive and "sigtermToExitSeconds" in recursive, recursive


# ------------------------------------------------------------------------- server-side dry run


@pytest.mark.parametrize(
    "values",
    [
        {"checkpointStorage": {"persistentVolumeClaim": {"claimName": "ckpt"}}},
        {"watchNamespaces": ["__NS__"], "replicaCount": 0},
    ],
    ids=["cluster-wide-pvc", "namespaced"],
)
def test_rendered_chart_passes_server_side_dry_run(
    control_plane: ControlPlane,
    tj_crd: None,
    helm: str,
    namespace: str,
    values: dict[str, Any],
    tmp_path: Path,
) -> None:
    values = json.loads(json.dumps(values).replace("__NS__", namespace))
    objects = render(helm, values, namespace=namespace, tmp_path=tmp_path, include_crds=True)
    proc = _apply(control_plane, objects, "--dry-run=server")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("(server dry run)") == len(objects), proc.stdout


def test_examples_pass_server_side_dry_run(
    control_plane: ControlPlane, tj_crd: None, kueue, namespace: str
) -> None:
    """The apiserver (TrainingJob CRD schema) and Kueue (its CRDs and webhooks) accept every
    example object."""
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        proc = _apply(control_plane, docs, "--dry-run=server", namespace=namespace)
        assert proc.returncode == 0, f"{path}: {proc.stdout}{proc.stderr}"
        assert proc.stdout.count("(server dry run)") == len(docs), proc.stdout
    # The same dry run does reject what the schemas and webhooks forbid.
    (_, tj) = yaml.safe_load_all((EXAMPLES / "minimal.yaml").read_text())
    tj["spec"]["numNodes"] = "two"
    (cq,) = [d for d in yaml.safe_load_all((EXAMPLES / "kueue/setup.yaml").read_text())
             if d["kind"] == "ClusterQueue"]  # fmt: skip
    cq["spec"]["preemption"]["withinClusterQueue"] = "Sometimes"
    for bad, field in ((tj, "numNodes"), (cq, "withinClusterQueue")):
        proc = _apply(control_plane, [bad], "--dry-run=server", namespace=namespace)
        assert proc.returncode != 0 and field in proc.stderr, proc.stdout + proc.stderr


# ---------------------------------------------------------- the operator under the chart's RBAC


def test_operator_with_chart_rbac_survives_preemptions(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj_crd: None,
    helm: str,
    namespace: str,
    tmp_path: Path,
    kueue: Kueue,
) -> None:
    """Namespaced install; the operator (chart args, ServiceAccount token) runs TrainingJobs that
    are preempted mid-run, both ways at once (one job's pod evicted; Kueue admitting a
    higher-priority job over another): each preempted attempt is recorded as a preemption, the
    next attempt resumes from the just-in-time checkpoint, the jobs succeed with no lost steps,
    and the operator never met a Forbidden answer. (One release for both kinds: two were 62 s of
    CI.)"""
    kueue.create_local_queue(namespace)
    checkpoint_root = tmp_path / "ckpt"
    checkpoint_root.mkdir()
    values = {
        "watchNamespaces": [namespace],
        "replicaCount": 0,
        "operator": {
            "logFormat": "text",
            "extraArgs": ["--poll-interval=1", "--status-progress-interval=0"],
        },
        "checkpointStorage": {"pathMap": {str(checkpoint_root): str(checkpoint_root)}},
    }
    with helm_release(control_plane, helm, namespace, values, tmp_path) as objects:
        (deployment,) = find_objects(objects, "Deployment")
        sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        sa_kubeconfig = control_plane.service_account_kubeconfig(namespace, sa)
        init = run_init_container(init_container(objects), sa_kubeconfig)
        assert init.returncode == 0, init.stdout + init.stderr
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        operator = ChartOperator(container, sa_kubeconfig, tmp_path / "operator.log")
        operator.start()
        try:
            with control_plane.api_client() as client:
                tj = TJClient(client, namespace)
                wait_for(
                    "the operator's liveness probe", operator.healthy, on_timeout=operator.tail
                )
                # The evicted job runs outside the queue (no queueName), beside the Kueue pair.
                evicted = _start_eviction_scenario(tj, operator, checkpoint_root)
                _kueue_scenario(tj, operator, checkpoint_root, kueue)
                evicted()
        finally:
            operator.stop()
        log = operator.log.read_text(errors="replace")
        assert "Forbidden" not in log and " 403" not in log, operator.tail(200)


def _describe(tj: TJClient, operator: ChartOperator, *names: str) -> str:
    return "\n".join(tj.describe(n) for n in names) + "\n--- operator ---\n" + operator.tail()


def _at_step(tj: TJClient, name: str, step: int) -> Any:
    """The running pod of attempt 1 once the job reported ``step``."""
    status = tj.status(name)
    return (
        tj.running_pod(name, 1) if (status.get("progress") or {}).get("step", 0) >= step else None
    )


def _assert_resumed_without_loss(status: dict[str, Any], max_steps: int, describe: str) -> None:
    assert status["phase"] == "Succeeded", describe
    assert status["preemptions"] >= 1, describe
    assert status["attempt"] >= 2, describe
    first, second = status["attempts"][:2]
    assert first["outcome"] == "Preempted", describe
    assert second["startStep"] == first["endStep"] > 0, describe
    assert status.get("lostSteps", 0) == 0, describe
    assert status["progress"]["step"] == max_steps, describe


def _start_eviction_scenario(
    tj: TJClient, operator: ChartOperator, checkpoint_root: Path
) -> Callable[[], None]:
    """Starts a job and evicts its pod at step 3; returns the check of how it ended."""
    tj.create(toy_training_job("evicted", checkpoint_root, max_steps=40, step_sleep=0.3))
    pod = wait_for(
        "attempt 1 at step 3",
        lambda: _at_step(tj, "evicted", 3),
        on_timeout=lambda: _describe(tj, operator, "evicted"),
    )
    tj.evict(pod.metadata.name)

    def check() -> None:
        status = wait_for(
            "Succeeded",
            lambda: tj.phase_is("evicted", "Succeeded", "Failed"),
            on_timeout=lambda: _describe(tj, operator, "evicted"),
        )
        _assert_resumed_without_loss(status, 40, _describe(tj, operator, "evicted"))

    return check


def _kueue_scenario(
    tj: TJClient, operator: ChartOperator, checkpoint_root: Path, kueue: Kueue
) -> None:
    """manifests/examples/kueue in small: a low-priority job holding the whole quota, then a
    high-priority one that Kueue admits by preempting it."""
    quota_cpu = kueue.quota["cpu"]

    def job(name: str, priority: str, max_steps: int):
        return toy_training_job(
            name, checkpoint_root, max_steps=max_steps, step_sleep=0.3, cpu=quota_cpu,
            queueName=kueue.local_queue, priorityClass=priority,
        )  # fmt: skip

    def describe() -> str:
        return _describe(tj, operator, "low", "high")

    tj.create(job("low", kueue.low_priority, 40))
    wait_for("low at step 3", lambda: _at_step(tj, "low", 3), on_timeout=describe)
    tj.create(job("high", kueue.high_priority, 5))
    wait_for("low preempted", lambda: tj.status("low").get("preemptions"), on_timeout=describe)
    high = wait_for(
        "high Succeeded", lambda: tj.phase_is("high", "Succeeded", "Failed"), on_timeout=describe
    )
    assert high["phase"] == "Succeeded", describe()
    low = wait_for(
        "low Succeeded", lambda: tj.phase_is("low", "Succeeded", "Failed"), on_timeout=describe
    )
    _assert_resumed_without_loss(low, 40, describe())
