"""Shared builders for the operator's pure-function tests (plain dicts in the apiserver's shape)."""

from __future__ import annotations

from typing import Any

from preemptible_operator import models


def make_spec(**overrides: Any) -> models.TrainingJobSpec:
    raw: dict[str, Any] = {
        "image": "preemptible:dev",
        "command": ["python", "-m", "trainer_runtime.toy"],
        "checkpoint": {"uri": "/ckpt/run"},
    }
    raw.update(overrides)
    return models.TrainingJobSpec.model_validate(raw)


def make_pod(
    name: str = "tj-a1-0-x",
    *,
    index: int = 0,
    phase: str = "Running",
    exit_code: int | None = None,
    message: str | None = None,
    conditions: list[dict[str, Any]] | None = None,
    node: str | None = "node-1",
    deleting: bool = False,
    grace: int = 30,
    reason: str | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
    if reason:
        status["reason"] = reason
    if exit_code is not None:
        terminated: dict[str, Any] = {"exitCode": exit_code, "reason": "Error"}
        if message is not None:
            terminated["message"] = message
        status["containerStatuses"] = [{"name": "trainer", "state": {"terminated": terminated}}]
    elif phase == "Running":
        status["containerStatuses"] = [{"name": "trainer", "state": {"running": {}}}]
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        "labels": {"preemptible.dev/training-job": "tj", "preemptible.dev/attempt": "1"},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": grace}
    if node:
        spec["nodeName"] = node
    return {"metadata": meta, "spec": spec, "status": status}


def make_job(
    *, completions: int = 1, suspend: bool = False, conditions: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": "tj-a1", "namespace": "ns", "uid": "job-uid"},
        "spec": {"completions": completions, "suspend": suspend},
        "status": {"conditions": conditions or []},
    }


def cond(ctype: str, reason: str = "", message: str = "", status: str = "True") -> dict[str, Any]:
    return {"type": ctype, "status": status, "reason": reason, "message": message}


META = {"name": "tj", "namespace": "ns", "uid": "uid-1"}


def make_snapshot(**overrides: Any) -> Any:
    """A reconcile pass's snapshot (observation.Snapshot): a valid spec, no attempt yet."""
    from preemptible_operator.observation import Snapshot

    fields: dict[str, Any] = {
        "obj": {"metadata": {**META, "generation": 1}},
        "status": models.TrainingJobStatus(),
        "spec": make_spec(),
        "invalid": None,
        "jobs": {},
        "pods_by_attempt": {},
        "attempt": 0,
        "job": None,
        "pods": [],
        "workload": None,
        "workload_version": None,
        "node_ready": {"node-1": True},  # make_pod's node
    }
    fields.update(overrides)
    return Snapshot(**fields)


def make_storage_snapshot(step: int, attempt: int = 1) -> Any:
    """The operator's look at storage (checkpoint_store.StorageSnapshot): checkpoint-<step>
    complete, nothing incomplete."""
    from preemptible_operator.checkpoint_store import StorageSnapshot
    from trainer_runtime.checkpoint.layout import CheckpointInfo

    name = f"checkpoint-{step}"
    return StorageSnapshot(
        latest_complete=CheckpointInfo(
            path=f"/ops/run/{name}",
            name=name,
            step=step,
            complete=True,
            reason=None,
            size_bytes=1,
            manifest=None,
            attempt=attempt,
        ),
        latest_complete_path=f"/ckpt/run/{name}",
        incomplete=(),
    )
