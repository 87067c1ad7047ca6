"""The user journey on the real control plane, as the README tells a new user: `helm install` of
the chart (its own operator pod, in-cluster credentials, its RBAC), then `kubectl apply` of
manifests/examples/minimal.yaml and of the Kueue examples. The high-priority TrainingJob preempts
the low-priority one; both finish; the low one resumes from its just-in-time checkpoint with no
lost steps. Pods get what a kubelet gives them from the node agent (docs/cluster-tests.md)."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.cluster.controlplane import ControlPlane, client_environment
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import TJClient, wait_for
from tests.packaging.chart import CHART_DIR
from tests.packaging.tools import REPO_ROOT, require_tool

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.kueue]

EXAMPLES = REPO_ROOT / "manifests" / "examples"
RELEASE = "journey"
# The example's 300 steps of 0.5 s would take 150 s of CI time; 100 (50 s) leave room for the
# operator's progress writes (every 15 s) and Kueue's preemption to land mid-run. Everything else
# is as written.
LOW_PRIORITY_STEPS = 100


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _with_max_steps(docs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    for doc in docs:
        if doc["kind"] == "TrainingJob":
            args = doc["spec"]["args"]
            doc["spec"]["args"] = [
                f"--max-steps={steps}" if a.startswith("--max-steps=") else a for a in args
            ]
    return docs


@contextlib.contextmanager
def _helm_install(cp: ControlPlane, helm: str, namespace: str, tmp_path: Path) -> Iterator[None]:
    values = tmp_path / "values.yaml"
    # What a user of one namespace would set; everything else is the chart's default.
    values.write_text(yaml.safe_dump({"watchNamespaces": [namespace]}))
    base = [helm, "--kubeconfig", str(cp.kubeconfig), "--namespace", namespace]
    install = subprocess.run(
        [*base, "install", RELEASE, str(CHART_DIR), "--values", str(values), "--wait",
         "--timeout", "240s"],
        capture_output=True, text=True, timeout=300, check=False, env=client_environment(),
    )  # fmt: skip
    try:
        assert install.returncode == 0, install.stdout + install.stderr
        yield
    finally:
        subprocess.run(
            [*base, "uninstall", RELEASE, "--wait", "--timeout", "120s"],
            capture_output=True, text=True, timeout=180, check=False, env=client_environment(),
        )  # fmt: skip


def _apply(cp: ControlPlane, namespace: str, docs: list[dict[str, Any]]) -> None:
    result = cp.kubectl(
        "apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(docs), check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _operator_log(agent: NodeAgent, namespace: str) -> str:
    records = [r for r in agent.records() if r.namespace == namespace and RELEASE in r.name]
    if not records:
        return "(no operator pod ran)"
    try:
        text = agent.log_path(namespace, records[-1].name, "operator").read_text(errors="replace")
    except (KeyError, OSError) as exc:
        return f"(no operator log: {exc})"
    return "\n".join(text.splitlines()[-80:])


def test_helm_install_then_minimal_and_kueue_examples(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    kueue: Any,
    namespace: str,
    tmp_path: Path,
) -> None:
    if node_agent.network is None:
        pytest.skip(f"in-cluster pods need network namespaces: {node_agent.network_unavailable}")
    helm = require_tool("helm")
    setup = _docs(EXAMPLES / "kueue" / "setup.yaml")
    with _helm_install(control_plane, helm, namespace, tmp_path), control_plane.api_client() as c:
        tj = TJClient(c, namespace)
        names = ("minimal", "low-priority", "high-priority")

        def describe() -> str:
            parts = [f"--- {n} ---\n{tj.describe(n)}" for n in names]
            return "\n".join(parts) + "\n--- operator ---\n" + _operator_log(node_agent, namespace)

        try:
            _apply(control_plane, namespace, setup)
            _apply(control_plane, namespace, _docs(EXAMPLES / "minimal.yaml"))
            low = _with_max_steps(
                _docs(EXAMPLES / "kueue" / "low-priority.yaml"), LOW_PRIORITY_STEPS
            )
            _apply(control_plane, namespace, low)
            wait_for(
                "low-priority training (step >= 3)",
                lambda: (tj.status("low-priority").get("progress") or {}).get("step", 0) >= 3,
                on_timeout=describe,
            )
            _apply(control_plane, namespace, _docs(EXAMPLES / "kueue" / "high-priority.yaml"))
            for name in names:
                status = wait_for(
                    f"{name} finished",
                    lambda name=name: tj.phase_is(name, "Succeeded", "Failed"),
                    on_timeout=describe,
                )
                assert status["phase"] == "Succeeded", describe()
            low_status = tj.status("low-priority")
            assert low_status["preemptions"] >= 1, describe()
            first, second = low_status["attempts"][:2]
            assert first["outcome"] == "Preempted", describe()
            assert second["startStep"] == first["endStep"] > 0, describe()
            assert low_status.get("lostSteps", 0) == 0, describe()
            assert low_status["progress"]["step"] == LOW_PRIORITY_STEPS, describe()
            assert tj.status("minimal")["progress"]["step"] == 200, describe()
            # The operator that did all this is the chart's own pod, with the chart's identity.
            core = kubernetes.client.CoreV1Api(c)
            (pod,) = core.list_namespaced_pod(
                namespace, label_selector=f"app.kubernetes.io/instance={RELEASE}"
            ).items
            assert pod.status.phase == "Running", describe()
            log = _operator_log(node_agent, namespace)
            assert "Forbidden" not in log and " 403" not in log, log
        finally:
            for name in names:
                with contextlib.suppress(Exception):
                    tj.custom.delete_namespaced_custom_object(
                        "preemptible.dev", "v1alpha1", namespace, "trainingjobs", name
                    )
            # The example's ClusterQueue; its flavor and priority classes have the names and
            # values of the kueue fixture's and stay.
            control_plane.kubectl(
                "delete", "clusterqueue.kueue.x-k8s.io/training", "--wait=false",
                "--ignore-not-found", check=False,
            )  # fmt: skip
