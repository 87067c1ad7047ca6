"""The chart's release on the real test control plane: helm against it, and what the release's
operator pod would run (init container, then `preemptible-operator run` with the Deployment's
arguments), as local processes authenticated with a token of the release's ServiceAccount."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.controlplane import ControlPlane, client_environment
from tests.cluster.processes import free_port, http_ok
from tests.operator.harness import read_metrics
from tests.packaging.chart import CHART_DIR, find_objects

__all__ = [
    "ChartOperator",
    "helm_release",
    "init_container",
    "release_objects",
    "run_helm",
    "run_init_container",
    "start_chart_operator",
]


def init_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = find_objects(objects, "Deployment")
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    return init


def run_init_container(init: dict[str, Any], kubeconfig: Path) -> subprocess.CompletedProcess:
    """The rendered init container's command, run here as the given identity (the node agent
    cannot give pods in-cluster credentials)."""
    env = {**client_environment(), "KUBECONFIG": str(kubeconfig), "PATH": os.environ["PATH"]}
    env.update({e["name"]: e["value"] for e in init.get("env", [])})
    argv = [sys.executable, *init["command"][1:]]
    assert init["command"][0] == "python"
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, check=False)


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

    def metrics(self) -> dict[str, float]:
        """The operator's /metrics, parsed: ``name{labels}`` -> value."""
        return read_metrics(self.metrics_port)

    def tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no operator log)"


@contextlib.contextmanager
def helm_release(
    cp: ControlPlane,
    helm: str,
    namespace: str,
    values: dict[str, Any],
    tmp_path: Path,
    release: str = "e2e",
) -> Iterator[list[dict[str, Any]]]:
    """`helm install` of the chart into ``namespace``; yields the release's objects. The release
    is not called "preemptible": its cluster-scoped objects must not collide with the plain
    install of the other tests in this module."""
    values_file = tmp_path / "release-values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    install = run_helm(
        cp, helm, namespace, "install", release, str(CHART_DIR), "--values", str(values_file)
    )
    assert install.returncode == 0, install.stdout + install.stderr
    try:
        yield release_objects(cp, helm, namespace, release)
    finally:
        run_helm(cp, helm, namespace, "uninstall", release, "--wait", "--timeout", "120s")


def run_helm(
    cp: ControlPlane, helm: str, namespace: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """helm against the test control plane (admin kubeconfig), in ``namespace``."""
    return subprocess.run(
        [helm, "--kubeconfig", str(cp.kubeconfig), "--namespace", namespace, *args],
        capture_output=True, text=True, timeout=300, check=False, env=client_environment(),
    )  # fmt: skip


def release_objects(
    cp: ControlPlane, helm: str, namespace: str, release: str
) -> list[dict[str, Any]]:
    """The objects of the release's current revision (`helm get manifest`)."""
    proc = run_helm(cp, helm, namespace, "get", "manifest", release)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def start_chart_operator(
    cp: ControlPlane, objects: list[dict[str, Any]], namespace: str, log: Path
) -> ChartOperator:
    """What the release's pod would do, outside the cluster (the node agent gives pods no
    in-cluster credentials): the init container, then the operator, both with a fresh token of
    the release's ServiceAccount."""
    (deployment,) = find_objects(objects, "Deployment")
    pod_spec = deployment["spec"]["template"]["spec"]
    kubeconfig = cp.service_account_kubeconfig(namespace, pod_spec["serviceAccountName"])
    init = run_init_container(init_container(objects), kubeconfig)
    assert init.returncode == 0, init.stdout + init.stderr
    (container,) = pod_spec["containers"]
    operator = ChartOperator(container, kubeconfig, log)
    operator.start()
    return operator
