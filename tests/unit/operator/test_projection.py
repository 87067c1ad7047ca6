"""The watch caches keep projections of Jobs, pods and Workloads (operator/projection.py). A pass
on projected children must decide, act and write exactly as on whole objects: each scenario runs
one real reconcile pass on whole objects (a Job rendered by the operator with its pod template,
pods with their containers, a Workload with its pod sets and admission) and one on their
projections, and compares what the passes did. A field a pass starts to read that the
projection drops makes the two differ here."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from preemptible_operator import models, projection, reconcile, render
from preemptible_operator.reconcile import Cached, OperatorConfig, Reconciler
from trainer_runtime import protocol

TJ_UID = "tj-uid-1"
JOB_UID = "job-uid-1"
CREATED = "2026-01-01T00:00:00Z"
NOW = 1_767_226_200.0  # 2026-01-01T00:10:00Z: both passes of a scenario run at the same time
MANAGED = [{"manager": "kube-controller-manager", "operation": "Update", "fieldsV1": {"f:x": {}}}]


def _spec(root: Path, **extra: Any) -> models.TrainingJobSpec:
    raw: dict[str, Any] = {
        "image": "preemptible:dev",
        "command": ["python", "-m", "trainer_runtime.toy"],
        "checkpoint": {"uri": str(root)},
        "resourcesPerNode": {"requests": {"cpu": "1", "memory": "1Gi"}},
        **extra,
    }
    return models.TrainingJobSpec.model_validate(raw)


def _tj(spec: models.TrainingJobSpec, phase: str, running: bool) -> dict[str, Any]:
    attempt: dict[str, Any] = {"attempt": 1, "jobName": "tj-a1", "startTime": CREATED}
    if running:
        attempt["runningTime"] = CREATED
    return {
        "apiVersion": models.API_VERSION,
        "kind": models.KIND,
        "metadata": {
            "name": "tj",
            "namespace": "ns",
            "uid": TJ_UID,
            "generation": 1,
            "resourceVersion": "10",
            "finalizers": ["preemptible.dev/operator"],
        },
        "spec": spec.to_k8s(),
        "status": {"phase": phase, "attempt": 1, "attempts": [attempt], "observedGeneration": 1},
    }


def _job(
    tj: dict[str, Any],
    spec: models.TrainingJobSpec,
    *,
    suspended: bool,
    conditions: list[Any],
    counts: dict[str, int],
) -> dict[str, Any]:
    params = render.AttemptParams(attempt=1, grace_seconds=30, resume_from="", suspended=suspended)
    job = render.render_job(tj["metadata"], spec, params)
    job["metadata"].update(
        uid=JOB_UID, resourceVersion="20", creationTimestamp=CREATED, managedFields=MANAGED
    )
    job["spec"]["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": JOB_UID}}
    job["status"] = {"conditions": conditions, "startTime": CREATED, **counts}
    return job


def _pod(job: dict[str, Any], *, node: str | None, status: dict[str, Any], **meta: Any) -> dict:
    template = job["spec"]["template"]
    spec = copy.deepcopy(template["spec"])
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "tj-a1-0-abcde",
            "namespace": "ns",
            "uid": "pod-uid-1",
            "resourceVersion": "30",
            "creationTimestamp": CREATED,
            "labels": {**template["metadata"]["labels"], "job-name": "tj-a1"},
            "annotations": {
                **template["metadata"].get("annotations", {}),
                render.JOB_COMPLETION_INDEX_ANNOTATION: "0",
            },
            "finalizers": [render.ATTEMPT_FINALIZER, "batch.kubernetes.io/job-tracking"],
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "tj-a1",
                    "uid": JOB_UID,
                    "controller": True,
                }
            ],
            "managedFields": MANAGED,
            **meta,
        },
        "spec": spec,
        "status": status,
    }


def _workload(job: dict[str, Any], conditions: list[Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {
            "name": "job-tj-a1-1a2b3",
            "namespace": "ns",
            "uid": "wl-uid-1",
            "resourceVersion": "40",
            "labels": {"kueue.x-k8s.io/job-uid": JOB_UID},
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": "tj-a1", "uid": JOB_UID}
            ],
            "managedFields": MANAGED,
        },
        "spec": {
            "active": True,
            "queueName": "q",
            "priority": 0,
            "podSets": [{"name": "main", "count": 1, "template": job["spec"]["template"]}],
            **spec,
        },
        "status": {
            "conditions": conditions,
            "admission": {
                "clusterQueue": "cq",
                "podSetAssignments": [
                    {"name": "main", "flavors": {"cpu": "default"}, "count": 1},
                ],
            },
            "resourceRequests": [{"name": "main", "resources": {"cpu": "1"}}],
        },
    }


def _cond(ctype: str, status: str = "True", reason: str = "", message: str = "") -> dict:
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": CREATED,
    }


def _running_status() -> dict[str, Any]:
    return {
        "phase": "Running",
        "conditions": [_cond("PodScheduled"), _cond("Ready")],
        "containerStatuses": [
            {"name": render.CONTAINER_NAME, "state": {"running": {"startedAt": CREATED}}}
        ],
        "startTime": CREATED,
    }


def _ended_status(code: int, message: dict[str, Any] | None, phase: str) -> dict[str, Any]:
    terminated: dict[str, Any] = {
        "exitCode": code,
        "reason": "Error" if code else "Completed",
        "startedAt": CREATED,
        "finishedAt": "2026-01-01T00:10:00Z",
    }
    if message is not None:
        terminated["message"] = json.dumps(message)
    return {
        "phase": phase,
        "conditions": [_cond("PodScheduled"), _cond("Ready", "False")],
        "containerStatuses": [{"name": render.CONTAINER_NAME, "state": {"terminated": terminated}}],
        "startTime": CREATED,
    }


def scenario(name: str, root: Path) -> tuple[dict[str, Any], Cached, dict[str, bool]]:
    """(TrainingJob, whole children, node readiness) of a named situation."""
    kueue = name.startswith("kueue")
    spec = _spec(root, **({"queueName": "q"} if kueue else {}))
    node_ready = {"node-1": True}
    admitted = [_cond("QuotaReserved"), _cond("Admitted")]
    running = name not in ("kueue-queued", "unschedulable")
    tj = _tj(spec, "Queued" if name == "kueue-queued" else "Running", running)
    suspended = name in ("kueue-queued", "kueue-preempted")
    job_conds: list[Any] = []
    if name == "preempted-exit":
        job_conds = [_cond("FailureTarget", reason="PodFailurePolicy"), _cond("Failed")]
    elif name == "succeeded":
        job_conds = [_cond("SuccessCriteriaMet"), _cond("Complete")]
    elif name == "kueue-preempted":
        job_conds = [_cond("Suspended", reason="JobSuspended")]
    counts = {
        "preempted-exit": {"failed": 1},
        "succeeded": {"succeeded": 1},
        "kueue-queued": {},
        "kueue-preempted": {"terminating": 1},
    }.get(name, {"active": 1})
    job = _job(tj, spec, suspended=suspended, conditions=job_conds, counts=counts)
    pods: list[dict[str, Any]] = []
    if name in ("running", "kueue-running", "kueue-deactivated"):
        pods = [_pod(job, node="node-1", status=_running_status())]
    elif name == "node-lost":
        pods = [_pod(job, node="node-1", status=_running_status())]
        node_ready = {"node-1": False}
    elif name == "preempted-exit":
        message = {"reason": "preempted", "step": 40, "complete": True, "checkpoint": "step-40"}
        status = _ended_status(protocol.EXIT_PREEMPTED, message, "Failed")
        pods = [_pod(job, node="node-1", status=status)]
    elif name == "succeeded":
        message = {"reason": "finished", "step": 100, "complete": True}
        pods = [_pod(job, node="node-1", status=_ended_status(0, message, "Succeeded"))]
    elif name == "kueue-preempted":
        status = _ended_status(143, None, "Failed")
        pods = [
            _pod(
                job,
                node="node-1",
                status=status,
                deletionTimestamp=CREATED,
                deletionGracePeriodSeconds=30,
            )
        ]
    elif name == "unschedulable":
        status = {
            "phase": "Pending",
            "conditions": [_cond("PodScheduled", "False", "Unschedulable", "0/4 nodes fit")],
        }
        pods = [_pod(job, node=None, status=status)]
    workloads: dict[str, dict[str, Any]] = {}
    if kueue:
        wl_conds = {
            "kueue-queued": [_cond("QuotaReserved", "False", "Pending", "no quota")],
            "kueue-running": admitted,
            "kueue-preempted": [
                _cond("QuotaReserved", "False"),
                _cond("Evicted", reason="Preempted", message="preempted by a higher priority"),
                _cond("Preempted", reason="InClusterQueue"),
            ],
            "kueue-deactivated": admitted,
        }[name]
        active = {"active": False} if name == "kueue-deactivated" else {}
        workloads = {JOB_UID: _workload(job, wl_conds, **active)}
    return tj, Cached(obj=tj, jobs=[job], pods=pods, workloads=workloads), node_ready


SCENARIOS = [
    "running",
    "node-lost",
    "preempted-exit",
    "succeeded",
    "unschedulable",
    "kueue-queued",
    "kueue-running",
    "kueue-preempted",
    "kueue-deactivated",
]


class Recording(Reconciler):
    """The real pass with the API at its edges recorded instead of sent."""

    def __init__(self, node_ready: dict[str, bool]) -> None:
        super().__init__(
            kubernetes.client.ApiClient(), OperatorConfig(scrape_metrics=False), clock=lambda: NOW
        )
        self.node_readiness = node_ready
        self.calls: list[tuple[str, Any]] = []

    def _node_ready(self, pods: list[dict[str, Any]]) -> dict[str, bool]:
        nodes = {(p.get("spec") or {}).get("nodeName") for p in pods} - {None}
        return {n: self.node_readiness.get(n, False) for n in nodes}

    def _put_status(self, obj: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("status", status))
        return {**obj, "metadata": {**obj["metadata"], "resourceVersion": "11"}, "status": status}

    def _event(self, obj: dict[str, Any], etype: str, reason: str, message: str) -> None:
        self.calls.append(("event", (etype, reason, message)))

    def _job_events(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def _stop_pods(self, pods: list[dict[str, Any]]) -> None:
        self.calls.append(("stop", sorted(p["metadata"]["name"] for p in pods)))

    def _release_pods(self, pods: list[dict[str, Any]]) -> int:
        self.calls.append(("release", sorted(p["metadata"]["name"] for p in pods)))
        return len(pods)

    def _deactivate_workload(self, namespace: str, workload: Any, version: str | None) -> None:
        self.calls.append(("deactivate", (workload or {}).get("metadata", {}).get("name")))

    def _suspend_for_deactivation(self, obj: dict[str, Any], message: str) -> None:
        self.calls.append(("suspend", message))

    def _clean_up_later(self, namespace: str, name: str, pods: Any, jobs: Any) -> None:
        self.calls.append(("cleanup", ([p["metadata"]["name"] for p in pods], len(jobs))))

    def _create_attempt(self, obs: Any, spec: Any, status: Any, *args: Any) -> None:
        self.calls.append(("create", obs.attempt))


def _projected(cached: Cached) -> Cached:
    return Cached(
        obj=cached.obj,
        jobs=[projection.project(j, "jobs") for j in cached.jobs],
        pods=[projection.project(p, "pods") for p in cached.pods],
        workloads={k: projection.project(w, "workloads") for k, w in cached.workloads.items()},
    )


@pytest.fixture(autouse=True)
def _frozen_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reconcile, "now_rfc3339", lambda: "2026-01-01T00:10:00Z")


def _pass(cached: Cached, node_ready: dict[str, bool]) -> tuple[Any, ...]:
    rec = Recording(node_ready)
    result = rec.reconcile("ns", "tj", copy.deepcopy(cached), scrape_metrics=False)
    return (result.phase, result.action, result.requeue_after is None, result.done, rec.calls)


@pytest.mark.parametrize("name", SCENARIOS)
def test_a_pass_on_projections_does_what_it_does_on_whole_objects(
    name: str, tmp_path: Path
) -> None:
    _, cached, node_ready = scenario(name, tmp_path / "ckpt")
    whole = _pass(cached, node_ready)
    assert whole[4], f"{name}: the pass did nothing to compare"
    assert _pass(_projected(cached), node_ready) == whole


def test_the_scenarios_reach_the_paths_that_read_children(tmp_path: Path) -> None:
    """The table above covers the decisions that read a child's fields: recording an ended
    attempt (exit codes, termination message), a Kueue preemption (Workload conditions), an
    administrator's deactivation (Workload spec.active), node loss, unschedulable pods."""
    actions = {}
    for name in SCENARIOS:
        _, cached, node_ready = scenario(name, tmp_path / name)
        phase, action, *_rest, calls = _pass(cached, node_ready)
        actions[name] = (phase, action, [c[0] for c in calls])
    assert actions["preempted-exit"][1] == "record_attempt"
    assert actions["succeeded"][1] == "record_attempt"
    assert "deactivate" in actions["kueue-preempted"][2] or "stop" in actions["kueue-preempted"][2]
    assert actions["kueue-deactivated"][2][0] == "suspend"
    assert actions["node-lost"][0] == "Checkpointing"
    assert actions["unschedulable"][0] == "Pending"
    assert actions["kueue-queued"][0] == "Queued"


def test_projections_drop_templates_and_managed_fields(tmp_path: Path) -> None:
    _, cached, _ = scenario("kueue-running", tmp_path)
    job = projection.project(cached.jobs[0], "jobs")
    pod = projection.project(cached.pods[0], "pods")
    workload = projection.project(cached.workloads[JOB_UID], "workloads")
    assert "template" not in job["spec"] and "managedFields" not in job["metadata"]
    assert "containers" not in pod["spec"] and "managedFields" not in pod["metadata"]
    assert set(workload["spec"]) == {"active", "priority"}
    assert set(workload["status"]) == {"conditions"}
    whole = sum(len(json.dumps(o)) for o in (cached.jobs[0], cached.workloads[JOB_UID]))
    slim = len(json.dumps(job)) + len(json.dumps(workload))
    assert slim < whole / 3


@pytest.mark.parametrize(
    ("owner", "cached"),
    [
        ({"apiVersion": "batch/v1", "kind": "Job", "name": "tj-a1"}, True),
        ({"apiVersion": "batch/v1", "kind": "Job", "name": "my-train-a12"}, True),
        ({"apiVersion": "batch/v1", "kind": "Job", "name": "nightly-etl"}, False),
        ({"apiVersion": "batch/v1", "kind": "Job", "name": "a1"}, False),
        ({"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "js-a1"}, False),
        ({"apiVersion": "v1", "kind": "Pod", "name": "p-a1"}, False),
        (None, False),
    ],
)
def test_only_workloads_of_attempt_jobs_are_cached(
    owner: dict[str, str] | None, cached: bool
) -> None:
    body = {"metadata": {"name": "w", "ownerReferences": [owner] if owner else []}}
    assert projection.attempt_workload(body) is cached


@pytest.mark.parametrize(
    ("owner", "training_job"),
    [("tj-a1", "tj"), ("my-train-a12", "my-train"), ("x-a2-a3", "x-a2"), ("nightly-etl", None)],
)
def test_a_workload_event_wakes_the_training_job_of_its_job(
    owner: str, training_job: str | None
) -> None:
    ref = {"apiVersion": "batch/v1", "kind": "Job", "name": owner}
    assert projection.training_job_of({"metadata": {"ownerReferences": [ref]}}) == training_job


def _pending(message: str, **extra: Any) -> dict[str, Any]:
    body = {
        "metadata": {"name": "w", "annotations": {}},
        "spec": {"active": True},
        "status": {"conditions": [_cond("QuotaReserved", "False", "Pending", message)]},
    }
    body.update(extra)
    return body


@pytest.mark.parametrize(
    ("after", "wakes"),
    [
        (_pending("position 7 in the queue"), False),  # Kueue rewrites the message
        (  # Kueue's first look adds a False condition
            _pending(
                "x",
                status={
                    "conditions": [
                        _cond("QuotaReserved", "False", "Pending", "x"),
                        _cond("PodsReady", "False", "WaitForStart"),
                    ]
                },
            ),
            False,
        ),
        (_pending("position 3", spec={"active": False}), True),  # deactivated
        (
            _pending(
                "x",
                status={"conditions": [_cond("QuotaReserved"), _cond("Admitted")]},
            ),
            True,
        ),
        (
            _pending("x", metadata={"name": "w", "annotations": {"a": "b"}}),
            True,
        ),
    ],
)
def test_only_a_change_a_pass_reads_of_a_workload_wakes_its_job(
    after: dict[str, Any], wakes: bool
) -> None:
    before = projection.workload_essence(_pending("position 8 in the queue"))
    assert (projection.workload_essence(after) != before) is wakes


def test_a_queued_job_has_no_timer_but_its_active_deadline(tmp_path: Path) -> None:
    """Queued: Kueue's admission and evictions arrive as watch events (budget.periodic_delay),
    so no periodic pass; with activeDeadlineSeconds a pass is still due at the deadline."""
    _, cached, node_ready = scenario("kueue-queued", tmp_path)
    rec = Recording(node_ready)
    assert rec.reconcile("ns", "tj", copy.deepcopy(cached)).requeue_after is None
    tj = copy.deepcopy(cached.obj)
    assert tj is not None
    tj["spec"]["activeDeadlineSeconds"] = 3600
    tj["status"]["startTime"] = "2026-01-01T00:00:00Z"
    with_deadline = Cached(obj=tj, jobs=cached.jobs, pods=cached.pods, workloads=cached.workloads)
    due = Recording(node_ready).reconcile("ns", "tj", with_deadline).requeue_after
    assert due is not None and 0 < due <= 3600
