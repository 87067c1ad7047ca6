"""Small helpers for tests on the real control plane: object builders and waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import kubernetes

__all__ = [
    "condition",
    "eventually",
    "job_manifest",
    "python_container",
    "wait_for_job_condition",
]

T = TypeVar("T")


def eventually(
    what: str, probe: Callable[[], T | None], *, timeout: float = 120.0, interval: float = 0.25
) -> T:
    """Poll ``probe`` until it returns something truthy and return that (generous timeouts:
    the machine is small and shared)."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    """The condition of type ``kind`` in ``obj["status"]["conditions"]`` (API JSON form)."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind:
            return cond
    return None


def python_container(
    code: str,
    *args: str,
    name: str = "main",
    cpu: str = "100m",
    env: Mapping[str, str] | None = None,
    mounts: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A container running ``python -c code args...`` in the test image (this project's venv)."""
    container: dict[str, Any] = {
        "name": name,
        "image": "preemptible:test",
        "command": ["python", "-c", code, *args],
        "resources": {"requests": {"cpu": cpu, "memory": "64Mi"}},
        "env": [{"name": k, "value": v} for k, v in (env or {}).items()],
    }
    if mounts:
        container["volumeMounts"] = [{"name": n, "mountPath": p} for n, p in mounts.items()]
    return container


def job_manifest(
    name: str,
    containers: list[dict[str, Any]],
    *,
    labels: Mapping[str, str] | None = None,
    completions: int = 1,
    parallelism: int = 1,
    indexed: bool = False,
    suspend: bool = False,
    grace_seconds: int = 30,
    volumes: list[dict[str, Any]] | None = None,
    backoff_limit: int = 0,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "completions": completions,
        "parallelism": parallelism,
        "backoffLimit": backoff_limit,
        "suspend": suspend,
        # No replacement pod while the old one is still terminating (checkpointing).
        "podReplacementPolicy": "Failed",
        "template": {
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": grace_seconds,
                "containers": containers,
                "volumes": volumes or [],
            }
        },
    }
    if indexed:
        spec["completionMode"] = "Indexed"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": spec,
    }


def wait_for_job_condition(
    client: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    kind: str = "Complete",
    *,
    timeout: float = 180.0,
) -> dict[str, Any]:
    """The Job once condition ``kind`` is True; fails fast if the Job Failed instead."""
    batch = kubernetes.client.BatchV1Api(client)

    def probe() -> dict[str, Any] | None:
        job = client.sanitize_for_serialization(batch.read_namespaced_job(name, namespace))
        cond = condition(job, kind)
        if cond and cond["status"] == "True":
            return job
        failed = condition(job, "Failed")
        if kind != "Failed" and failed and failed["status"] == "True":
            raise AssertionError(f"Job {namespace}/{name} failed: {failed}")
        return None

    return eventually(f"Job {namespace}/{name} condition {kind}", probe, timeout=timeout)
