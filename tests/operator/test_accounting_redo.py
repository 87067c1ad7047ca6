"""An ended attempt is counted once, with its own steps only, on the real control plane (issue 30).

The Reconciler runs in this process against the real apiserver; its watch caches are given as
the pass's ``Cached`` input (the ended attempt's Job and pod as the caches would show them: no
kubelet is needed to end an attempt). The status write conflict is a real one: another writer
changes the TrainingJob's status between the pass's read and its write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from preemptible_operator import metrics, models, render
from preemptible_operator.reconcile import Cached, OperatorConfig, Reconciler
from tests.cluster.controlplane import ControlPlane
from tests.operator.harness import TJClient, toy_training_job

pytestmark = [pytest.mark.cluster]


def _counted() -> tuple[float, float]:
    """(preemptions, lost steps) the operator's counters hold, all labels together."""

    def total(counter: Any) -> float:
        return sum(
            s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")
        )

    return total(metrics.PREEMPTIONS), total(metrics.LOST_STEPS)


def _put_status(tj: TJClient, obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    body = {**obj, "status": status}
    return tj.custom.replace_namespaced_custom_object_status(
        models.GROUP, models.VERSION, tj.ns, models.PLURAL, obj["metadata"]["name"], body
    )


def _ended_attempt(tj_obj: dict[str, Any], attempt: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attempt's Job and its evicted pod, as the watch caches hold them (the pod exited on
    SIGTERM while still loading: no termination message, no step reported)."""
    meta = tj_obj["metadata"]
    name, uid = meta["name"], meta["uid"]
    labels = {render.LABEL_TRAINING_JOB: name, render.LABEL_ATTEMPT: str(attempt)}
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": render.job_name(name, attempt),
            "namespace": meta["namespace"],
            "uid": f"job-{attempt}-{uid}",
            "labels": labels,
            "ownerReferences": [
                {"apiVersion": models.API_VERSION, "kind": models.KIND, "name": name, "uid": uid}
            ],
        },
        "spec": {"completions": 1, "suspend": False},
        "status": {"failed": 1},
    }
    pod = {
        "metadata": {
            "name": f"{render.job_name(name, attempt)}-0-abcde",
            "namespace": meta["namespace"],
            "uid": f"pod-{attempt}-{uid}",
            "labels": labels,
            "annotations": {
                "batch.kubernetes.io/job-completion-index": "0",
                render.ANNOTATION_TJ_UID: uid,
            },
        },
        "spec": {"terminationGracePeriodSeconds": 30},
        "status": {
            "phase": "Failed",
            "conditions": [
                {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
            ],
            "containerStatuses": [
                {"name": "trainer", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}
            ],
        },
    }
    return job, pod


def test_an_attempt_preempted_while_loading_is_counted_once_with_its_own_steps(
    control_plane: ControlPlane, tj_crd: None, namespace: str, tj: TJClient, checkpoint_root: Path
) -> None:
    name = "acct"
    created = tj.create(toy_training_job(name, checkpoint_root))
    # Attempt 1 reached step 150 with checkpoint 100 (50 steps lost, counted); attempt 2 resumed
    # from 100, ran, and is preempted before its first step: the job's progress still shows
    # attempt 1's step.
    ckpt = f"{checkpoint_root}/{name}/checkpoint-100"
    status = {
        "phase": "Running",
        "attempt": 2,
        "attempts": [
            {
                "attempt": 1,
                "jobName": render.job_name(name, 1),
                "startTime": "2026-01-01T00:00:00Z",
                "runningTime": "2026-01-01T00:00:10Z",
                "endTime": "2026-01-01T01:00:00Z",
                "outcome": "Preempted",
                "reason": "PodEvicted",
                "startStep": 0,
                "endStep": 150,
                "checkpoint": ckpt,
                "lostSteps": 50,
            },
            {
                "attempt": 2,
                "jobName": render.job_name(name, 2),
                "startTime": "2026-01-01T01:00:05Z",
                "runningTime": "2026-01-01T01:00:20Z",
                "startStep": 100,
                "resumeFrom": ckpt,
                "graceSeconds": 30,
            },
        ],
        "progress": {"step": 150, "attempt": 1},
        "lastCompleteCheckpoint": {"step": 100, "path": ckpt},
        "preemptions": 1,
        "lostSteps": 50,
    }
    read = _put_status(tj, created, status)
    job, pod = _ended_attempt(read, 2)

    with control_plane.api_client() as client:
        reconciler = Reconciler(client, OperatorConfig(scrape_metrics=False, kueue=False))
        before = _counted()

        # Another writer changes the status after the pass read it: its write is refused (409)
        # and the pass is to be redone; nothing it recorded may be counted.
        _put_status(tj, read, {**status, "message": "written by another client"})
        result = reconciler.reconcile(namespace, name, Cached(read, [job], [pod], {}))
        assert result.action == "record_attempt" and result.requeue_after == 0.5, result
        assert _counted() == before
        assert tj.status(name)["attempts"][1].get("endTime") is None

        # The redone pass (on the fresh object) records the attempt, and counts it, once.
        fresh = tj.get(name)
        result = reconciler.reconcile(namespace, name, Cached(fresh, [job], [pod], {}))
        assert result.action == "record_attempt" and result.requeue_after == 0.0, result
        after = tj.status(name)
        second = after["attempts"][1]
        assert second["outcome"] == "Preempted", after
        # its own step: the one it started from, not attempt 1's 150; nothing lost again
        assert (second["endStep"], second["lostSteps"]) == (100, 0), second
        assert (after["preemptions"], after["lostSteps"]) == (2, 50), after
        assert _counted() == (before[0] + 1, before[1])
