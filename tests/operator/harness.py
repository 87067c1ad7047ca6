"""Helpers for the operator tier: the CRD, the operator as a subprocess, TrainingJob builders and
waits. The control plane, node agent and Kueue come from tests/cluster/fixtures.py."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.client.exceptions import ApiException

from preemptible_operator import crd, models, render

__all__ = [
    "OperatorProcess",
    "TJClient",
    "delete_training_jobs",
    "free_port",
    "install_crd",
    "read_metrics",
    "toy_training_job",
    "wait_for",
    "wait_for_policy",
]

# Generous: 2 shared cores, torch imports take seconds per pod start.
TIMEOUT = float(os.environ.get("PREEMPTIBLE_OPERATOR_TEST_TIMEOUT", "240"))


def wait_for(
    what: str,
    probe: Callable[[], Any],
    timeout: float = TIMEOUT,
    interval: float = 0.5,
    on_timeout: Callable[[], str] | None = None,
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{on_timeout()}" if on_timeout else ""
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}{extra}")
        time.sleep(interval)


def wait_for_policy(client: kubernetes.client.ApiClient, namespace: str) -> None:
    """Wait until the operator's admission policy refuses ``client`` (the operator's identity) a
    Job of no TrainingJob: the apiserver loads new policies asynchronously. Dry run: nothing is
    created either way."""
    batch = kubernetes.client.BatchV1Api(client)
    body = {
        "metadata": {"generateName": "policy-probe-"},
        "spec": {
            "suspend": True,
            "template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "none"}]}
            },
        },
    }

    def refused() -> bool:
        try:
            batch.create_namespaced_job(namespace, body, dry_run="All")
        except ApiException as exc:
            if exc.status == 403 and "preemptible operator" in str(exc.body):
                return True
            raise
        return False

    wait_for("the operator's admission policy in force", refused, timeout=60)


def install_crd(
    api_client: kubernetes.client.ApiClient, body: dict[str, Any] | None = None
) -> None:
    """Create (or replace) the generated CRD (or ``body``) and wait until it is Established."""
    ext = kubernetes.client.ApiextensionsV1Api(api_client)
    body = body or yaml.safe_load(crd.CRD_PATHS[0].read_text())
    name = body["metadata"]["name"]
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        current = ext.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        ext.replace_custom_resource_definition(name, body)

    def established() -> bool:
        obj = ext.read_custom_resource_definition(name)
        return any(
            c.type == "Established" and c.status == "True" for c in obj.status.conditions or []
        )

    wait_for(f"CRD {name} Established", established, timeout=60)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_metrics(port: int) -> dict[str, float]:
    """An operator's /metrics on this machine, parsed: ``name{labels}`` -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


class OperatorProcess:
    """``preemptible-operator run`` as a subprocess (killed by its own PID only)."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        checkpoint_root: Path,
        log: Path,
        extra: tuple[str, ...] = (),
        metrics_port: int = 0,
    ) -> None:
        self.metrics_port = metrics_port
        self.argv = [
            sys.executable,
            "-m",
            "preemptible_operator.cli",
            "run",
            "--kubeconfig",
            str(kubeconfig),
            "--namespace",
            namespace,
            "--checkpoint-path-map",
            f"{checkpoint_root}={checkpoint_root}",
            "--metrics-port",
            str(metrics_port),
            "--liveness",
            "",
            "--poll-interval",
            "1",
            # Tests watch the step in the status; production throttles progress-only writes.
            "--status-progress-interval",
            "0",
            "--log-format",
            "text",
            *extra,
        ]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        fh = self.log.open("ab")
        fh.write(f"\n===== operator start {self.starts} =====\n".encode())
        fh.flush()
        self.proc = subprocess.Popen(self.argv, stdout=fh, stderr=subprocess.STDOUT)
        fh.close()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop abruptly (default SIGKILL: no cleanup at all, the harshest restart)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> dict[str, float]:
        """The operator's /metrics, parsed: ``name{labels}`` -> value (needs ``metrics_port``)."""
        return read_metrics(self.metrics_port)

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no operator log)"


class TJClient:
    """TrainingJob CRUD and observation in one namespace."""

    def __init__(self, api_client: kubernetes.client.ApiClient, namespace: str) -> None:
        self.ns = namespace
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.batch = kubernetes.client.BatchV1Api(api_client)
        self.core = kubernetes.client.CoreV1Api(api_client)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.custom.create_namespaced_custom_object(
            models.GROUP, models.VERSION, self.ns, models.PLURAL, body
        )

    def get(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            models.GROUP, models.VERSION, self.ns, models.PLURAL, name
        )

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            models.GROUP, models.VERSION, self.ns, models.PLURAL, name, {"spec": spec}
        )

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def jobs(self, name: str) -> list[Any]:
        return self.batch.list_namespaced_job(
            self.ns, label_selector=f"{render.LABEL_TRAINING_JOB}={name}"
        ).items

    def pods(self, name: str, attempt: int | None = None) -> list[Any]:
        selector = f"{render.LABEL_TRAINING_JOB}={name}"
        if attempt is not None:
            selector += f",{render.LABEL_ATTEMPT}={attempt}"
        return self.core.list_namespaced_pod(self.ns, label_selector=selector).items

    def running_pod(self, name: str, attempt: int) -> Any | None:
        for pod in self.pods(name, attempt):
            if pod.status.phase == "Running" and not pod.metadata.deletion_timestamp:
                return pod
        return None

    def evict(self, pod_name: str) -> None:
        self.core.create_namespaced_pod_eviction(
            pod_name,
            self.ns,
            {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": pod_name, "namespace": self.ns},
            },
        )

    def events(self, name: str) -> list[tuple[str, str]]:
        items = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.name={name}"
        ).items
        items.sort(key=lambda e: (e.last_timestamp or e.event_time or 0, e.metadata.name))
        return [(e.reason, e.message) for e in items if e.involved_object.kind == models.KIND]

    def phase_is(self, name: str, *phases: str) -> dict[str, Any] | None:
        status = self.status(name)
        return status if status.get("phase") in phases else None

    def describe(self, name: str) -> str:
        with contextlib.suppress(ApiException):
            status = self.status(name)
            jobs = [
                (
                    j.metadata.name,
                    j.spec.suspend,
                    j.status.conditions and [(c.type, c.reason) for c in j.status.conditions],
                )
                for j in self.jobs(name)
            ]
            pods = [
                (p.metadata.name, p.status.phase, bool(p.metadata.deletion_timestamp))
                for p in self.pods(name)
            ]
            return f"status: {yaml.safe_dump(status)}\njobs: {jobs}\npods: {pods}"
        return "(unavailable)"


def toy_training_job(
    name: str,
    checkpoint_root: Path,
    *,
    max_steps: int = 12,
    step_sleep: float = 0.2,
    save_steps: int = 1000,
    extra_args: tuple[str, ...] = (),
    grace: dict[str, Any] | None = None,
    cpu: str = "200m",
    **spec: Any,
) -> dict[str, Any]:
    """A TrainingJob that runs ``python -m trainer_runtime.toy`` with checkpoints on a hostPath
    volume mounted at the same path (so the operator can read them through an identity map)."""
    root = str(checkpoint_root)
    body_spec: dict[str, Any] = {
        "image": "preemptible:test",
        "command": ["python", "-m", "trainer_runtime.toy"],
        "args": [
            "--max-steps",
            str(max_steps),
            "--step-sleep",
            str(step_sleep),
            "--save-steps",
            str(save_steps),
            "--threads",
            "1",
            *extra_args,
        ],
        "checkpoint": {"uri": f"{root}/{name}"},
        "resourcesPerNode": {"requests": {"cpu": cpu, "memory": "256Mi"}},
        "volumes": [{"name": "ckpt", "hostPath": {"path": root, "type": "DirectoryOrCreate"}}],
        "volumeMounts": [{"name": "ckpt", "mountPath": root}],
        "gracePeriod": grace or {"initialSeconds": 30, "min": 5, "max": 120},
    }
    body_spec.update(spec)
    return {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "metadata": {"name": name},
        "spec": body_spec,
    }


def delete_training_jobs(
    client: kubernetes.client.ApiClient, namespace: str, op: OperatorProcess
) -> None:
    """Delete a test's TrainingJobs while the operator still runs (it holds their finalizer),
    so the namespace can go away; best effort."""
    custom = kubernetes.client.CustomObjectsApi(client)
    args = (models.GROUP, models.VERSION, namespace, models.PLURAL)
    with contextlib.suppress(Exception):
        if not op.alive():
            op.start()
        for item in custom.list_namespaced_custom_object(*args)["items"]:
            custom.delete_namespaced_custom_object(*args, item["metadata"]["name"])
        wait_for(
            "TrainingJobs deleted",
            lambda: not custom.list_namespaced_custom_object(*args)["items"],
            timeout=60,
        )


@contextlib.contextmanager
def running_operator(op: OperatorProcess) -> Iterator[OperatorProcess]:
    op.start()
    try:
        yield op
    finally:
        op.kill(signal.SIGTERM)
