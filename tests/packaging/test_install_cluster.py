"""The chart and the plain manifests on the real control plane (tests/cluster): the apiserver
validates every rendered object, one `kubectl apply` installs manifests/install.yaml, the RBAC
grants what docs/install.md says and nothing more, and the operator runs a full preemption
scenario authenticated as the chart's ServiceAccount (a bound token, not admin)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.cluster.controlplane import ControlPlane, client_environment
from tests.cluster.kueue import Kueue
from tests.cluster.node_agent import NodeAgent
from tests.cluster.processes import free_port, http_ok
from tests.operator.harness import TJClient, install_crd, toy_training_job, wait_for
from tests.packaging.chart import CHART_DIR, find_objects, render
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


def _init_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = find_objects(objects, "Deployment")
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    return init


def _run_init_container(init: dict[str, Any], kubeconfig: Path) -> subprocess.CompletedProcess:
    """The rendered init container's command, run here as the given identity (the node agent
    cannot give pods in-cluster credentials)."""
    env = {**client_environment(), "KUBECONFIG": str(kubeconfig), "PATH": os.environ["PATH"]}
    env.update({e["name"]: e["value"] for e in init.get("env", [])})
    argv = [sys.executable, *init["command"][1:]]
    assert init["command"][0] == "python"
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)


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
    init = _init_container(plain_install)
    first = _run_init_container(init, sa_kubeconfig)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "ClusterKopfPeering preemptible" in first.stdout
    again = _run_init_container(init, sa_kubeconfig)
    assert again.returncode == 0 and "exists" in again.stdout, again.stdout + again.stderr
    control_plane.kubectl("get", "clusterkopfpeering", "preemptible")


@pytest.mark.parametrize(
    ("verb", "resource", "allowed"),
    [
        ("watch", "trainingjobs.preemptible.dev", True),
        ("patch", "trainingjobs.preemptible.dev", True),
        ("update", "trainingjobs.preemptible.dev/status", True),
        ("create", "jobs.batch", True),
        ("delete", "jobs.batch", True),
        ("create", "services", True),
        ("patch", "pods", True),
        ("create", "events", True),
        ("patch", "workloads.kueue.x-k8s.io", True),
        ("patch", "clusterkopfpeerings.kopf.dev", True),
        ("get", "nodes", True),
        ("watch", "customresourcedefinitions.apiextensions.k8s.io", True),
        # ... and nothing more.
        ("get", "secrets", False),
        ("list", "configmaps", False),
        ("create", "pods", False),
        ("create", "pods/eviction", False),
        ("delete", "trainingjobs.preemptible.dev", False),
        ("create", "trainingjobs.preemptible.dev", False),
        ("update", "jobs.batch", False),
        ("delete", "services", False),
        ("delete", "workloads.kueue.x-k8s.io", False),
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


class ChartOperator:
    """`preemptible-operator run` with the arguments of the chart's Deployment, as a subprocess
    authenticated with a token of the chart's ServiceAccount. Stopped by its own PID."""

    def __init__(self, container: dict[str, Any], kubeconfig: Path, log: Path) -> None:
        self.health_port = free_port()
        self.metrics_port = free_port()
        args = []
        for arg in container["args"]:
            # Loopback ports of our own: several test sessions may share this machine.
            if arg.startswith("--liveness="):
                arg = f"--liveness=http://127.0.0.1:{self.health_port}/healthz"
            elif arg.startswith("--metrics-port="):
                arg = f"--metrics-port={self.metrics_port}"
            args.append(arg)
        assert container["command"] == ["preemptible-operator"]
        self.argv = [sys.executable, "-m", "preemptible_operator.cli", *args]
        self.argv += ["--kubeconfig", str(kubeconfig)]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as fh:
            env = {**client_environment(), "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen(self.argv, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def healthy(self) -> bool:
        assert self.proc is not None
        assert self.proc.poll() is None, f"operator exited {self.proc.returncode}:\n{self.tail()}"
        return http_ok(f"http://127.0.0.1:{self.health_port}/healthz")

    def tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no operator log)"


@contextlib.contextmanager
def helm_release(
    cp: ControlPlane, helm: str, namespace: str, values: dict[str, Any], tmp_path: Path
) -> Iterator[list[dict[str, Any]]]:
    """`helm install` of the chart into ``namespace``; yields the release's objects. The release
    is not called "preemptible": its cluster-scoped objects must not collide with the plain
    install of the other tests in this module."""
    values_file = tmp_path / "release-values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    base = [helm, "--kubeconfig", str(cp.kubeconfig), "--namespace", namespace]
    install = subprocess.run(
        [*base, "install", RELEASE, str(CHART_DIR), "--values", str(values_file)],
        capture_output=True, text=True, timeout=300, check=False, env=client_environment(),
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    try:
        manifest = subprocess.run(
            [*base, "get", "manifest", RELEASE],
            capture_output=True, text=True, timeout=120, check=True, env=client_environment(),
        ).stdout  # fmt: skip
        yield [d for d in yaml.safe_load_all(manifest) if d]
    finally:
        subprocess.run(
            [*base, "uninstall", RELEASE, "--wait", "--timeout", "120s"],
            capture_output=True, text=True, timeout=180, check=False, env=client_environment(),
        )  # fmt: skip


@pytest.mark.parametrize("preemption", ["eviction", "kueue"])
def test_operator_with_chart_rbac_survives_a_preemption(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj_crd: None,
    helm: str,
    namespace: str,
    tmp_path: Path,
    preemption: str,
    request: pytest.FixtureRequest,
) -> None:
    """Namespaced install; the operator (chart args, ServiceAccount token) runs a TrainingJob that
    is preempted mid-run (its pod evicted, or Kueue admitting a higher-priority job): the attempt
    is recorded as a preemption, the next attempt resumes from the just-in-time checkpoint, the
    job succeeds with no lost steps, and the operator never met a Forbidden answer."""
    kueue = request.getfixturevalue("kueue") if preemption == "kueue" else None
    if kueue is not None:
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
        init = _run_init_container(_init_container(objects), sa_kubeconfig)
        assert init.returncode == 0, init.stdout + init.stderr
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        operator = ChartOperator(container, sa_kubeconfig, tmp_path / "operator.log")
        operator.start()
        try:
            with control_plane.api_client() as client:
                tj = TJClient(client, namespace)
                if kueue is None:
                    _eviction_scenario(tj, operator, checkpoint_root)
                else:
                    _kueue_scenario(tj, operator, checkpoint_root, kueue)
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


def _eviction_scenario(tj: TJClient, operator: ChartOperator, checkpoint_root: Path) -> None:
    wait_for("the operator's liveness probe", operator.healthy, on_timeout=operator.tail)
    tj.create(toy_training_job("evicted", checkpoint_root, max_steps=40, step_sleep=0.3))
    pod = wait_for(
        "attempt 1 at step 3",
        lambda: _at_step(tj, "evicted", 3),
        on_timeout=lambda: _describe(tj, operator, "evicted"),
    )
    tj.evict(pod.metadata.name)
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("evicted", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, operator, "evicted"),
    )
    _assert_resumed_without_loss(status, 40, _describe(tj, operator, "evicted"))


def _kueue_scenario(
    tj: TJClient, operator: ChartOperator, checkpoint_root: Path, kueue: Kueue
) -> None:
    """manifests/examples/kueue in small: a low-priority job holding the whole quota, then a
    high-priority one that Kueue admits by preempting it."""
    wait_for("the operator's liveness probe", operator.healthy, on_timeout=operator.tail)
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
