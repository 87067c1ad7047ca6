"""Decisions about an attempt's children (issue 30, second review): refused creates, when the
attempt's pods are all over, pods held running by a sidecar, and which ended Jobs are kept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from preemptible_operator import render
from preemptible_operator.children import (
    JOB_TRACKING_FINALIZER,
    REFUSAL_RETRY_MAX,
    REFUSAL_RETRY_MIN,
    api_message,
    attempt_pods_finished,
    create_refusal,
    held_pods,
    jobs_to_delete,
    kept_failed_attempt,
    pods_refused,
    pods_to_end,
    refusal_retry_seconds,
    restarted_pods,
)
from preemptible_operator.conditions import Reason
from preemptible_operator.render import (
    ATTEMPT_FINALIZER,
    CONTAINER_NAME,
    JOB_COMPLETION_INDEX_ANNOTATION,
)
from tests.unit.operator.builders import cond, make_job, make_pod, make_spec


def _job(
    *,
    active: int | None = None,
    terminating: int | None = None,
    ready: int | None = None,
    completions: int | None = 1,
    suspend: bool = False,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    job = make_job(suspend=suspend, conditions=conditions)
    if completions is None:
        del job["spec"]["completions"]
    else:
        job["spec"]["completions"] = job["spec"]["parallelism"] = completions
    for key, value in (("active", active), ("terminating", terminating), ("ready", ready)):
        if value is not None:
            job["status"][key] = value
    return job


FAILED = make_pod(phase="Failed", exit_code=1)
SUCCEEDED = make_pod(phase="Succeeded", exit_code=0)
RUNNING = make_pod(phase="Running")
# Deleted before it was bound: finished, though its phase is still Pending (the Job counts it
# as terminating while our finalizer holds it).
UNBOUND_DELETED = make_pod(phase="Pending", node=None, deleting=True)


def _ended(
    index: int = 0,
    *,
    phase: str = "Failed",
    exit_code: int = 75,
    tracked: bool = True,
    deleting: bool = False,
    disrupted: bool = False,
    index_in: str = "annotations",
) -> dict[str, Any]:
    """An attempt pod in a terminal phase. ``tracked``: it still holds the Job controller's
    tracking finalizer (not counted yet); ``disrupted``: DisruptionTarget=True."""
    pod = make_pod(
        f"tj-a1-{index}-x",
        index=index,
        phase=phase,
        exit_code=exit_code,
        deleting=deleting,
        conditions=[cond("DisruptionTarget", "EvictionByEvictionAPI")] if disrupted else None,
    )
    meta = pod["metadata"]
    if index_in != "annotations":
        raw = meta["annotations"].pop(JOB_COMPLETION_INDEX_ANNOTATION)
        if index_in == "labels":
            meta["labels"][JOB_COMPLETION_INDEX_ANNOTATION] = raw
        else:
            meta["annotations"][JOB_COMPLETION_INDEX_ANNOTATION] = index_in
    meta["finalizers"] = [ATTEMPT_FINALIZER, *([JOB_TRACKING_FINALIZER] if tracked else [])]
    return pod


# The runtime's exit 75 (a JIT checkpoint on a node notice): the pod ended on its own.
EXIT_75 = _ended()
# Counted by the Job controller (finalizer removed), though the Job seen does not show it yet.
EXIT_75_COUNTED = _ended(tracked=False)
# Evicted (a drain, the scheduler's preemption): not counted yet.
EVICTED = _ended(exit_code=143, deleting=True, disrupted=True)
# Deleted by someone other than the Job controller (the operator, a user): it is counted.
DELETED_TRACKED = _ended(deleting=True)
# Deleted by the Job controller when the Job was suspended: finalizer stripped first, never
# counted; its index gets a new pod once the Job is resumed.
SUSPEND_VICTIM = _ended(tracked=False, deleting=True)
# The same, then marked Failed with DisruptionTarget by the pod garbage collector (its node was
# removed): still never counted.
SUSPEND_VICTIM_DISRUPTED = _ended(tracked=False, deleting=True, disrupted=True)
# Being deleted on a node that is gone (not in node_ready): finished, not terminal.
ON_LOST_NODE = make_pod("tj-a1-1-x", index=1, phase="Running", node="node-gone", deleting=True)


# --------------------------------------------------------------------------- defect 7
@pytest.mark.parametrize(
    ("job", "pods", "finished"),
    [
        pytest.param(_job(), [], True, id="no-pods-job-idle"),
        pytest.param(None, [], True, id="no-job-no-pods"),
        pytest.param(None, [FAILED], True, id="job-gone-pods-terminal"),
        # The watch cache shows no pod yet, the Job controller counts one: it may run.
        pytest.param(_job(active=1), [], False, id="cache-lags-job-active"),
        pytest.param(_job(active=1, ready=1), [], False, id="cache-lags-job-ready"),
        pytest.param(_job(ready=1), [], False, id="ready-only"),
        pytest.param(_job(terminating=1), [], False, id="cache-lags-job-terminating"),
        # An eviction right after admission: one pod seen terminal, a second one not seen.
        pytest.param(_job(active=1, completions=2), [FAILED], False, id="one-seen-one-unseen"),
        pytest.param(_job(active=0, terminating=0), [FAILED, SUCCEEDED], True, id="all-terminal"),
        pytest.param(_job(active=0), [RUNNING], False, id="seen-pod-running"),
        # Pods finished by the operator's rule but not terminal: the Job may still count them.
        pytest.param(_job(terminating=1), [UNBOUND_DELETED], True, id="held-unbound-deleted"),
        pytest.param(
            _job(terminating=2), [UNBOUND_DELETED], False, id="more-terminating-than-seen"
        ),
        # ---- no pod can follow (issue 30, requeue p50): the Job's status still counts the
        # ended pods (the controller writes it about 1 s later), yet nothing else can run.
        pytest.param(_job(active=1, ready=1), [EXIT_75], True, id="exit-75-job-not-updated"),
        pytest.param(_job(active=1), [EXIT_75_COUNTED], True, id="exit-75-counted"),
        pytest.param(_job(active=0, terminating=1), [EVICTED], True, id="evicted"),
        pytest.param(_job(terminating=1), [DELETED_TRACKED], True, id="deleted-not-by-job"),
        pytest.param(
            _job(active=2, completions=2),
            [EXIT_75, _ended(1, exit_code=143, deleting=True)],
            True,
            id="multinode-rank-ended-peer-stopped",
        ),
        pytest.param(
            _job(active=1, completions=2),
            [_ended(phase="Succeeded", exit_code=0), _ended(1, exit_code=1)],
            True,
            id="multinode-one-failed-one-done",
        ),
        pytest.param(
            _job(active=2, completions=2),
            [_ended(phase="Succeeded", exit_code=0), _ended(1, phase="Succeeded", exit_code=0)],
            True,
            id="all-indexes-succeeded",
        ),
        pytest.param(_job(active=1), [_ended(index_in="labels")], True, id="index-from-label"),
        # Resumed by Kueue earlier (Suspended False): only a True condition means suspended.
        pytest.param(
            _job(active=1, conditions=[cond("Suspended", "JobResumed", status="False")]),
            [EXIT_75],
            True,
            id="resumed-job",
        ),
        # A victim of an earlier suspension and the pod that replaced it, both seen.
        pytest.param(
            _job(active=1), [SUSPEND_VICTIM, EXIT_75], True, id="victim-and-its-replacement"
        ),
        # ---- still waits for the count:
        # Index 1 has no pod seen: one may run (created, not in the cache yet).
        pytest.param(_job(active=2, completions=2), [EXIT_75], False, id="index-missing"),
        # The Job already counts index 0 as failed and still counts a pod we do not see.
        pytest.param(
            _job(active=1, completions=2), [EXIT_75_COUNTED], False, id="job-counts-unseen"
        ),
        pytest.param(_job(active=1, suspend=True), [EXIT_75], False, id="job-suspended"),
        pytest.param(
            _job(active=1, conditions=[cond("Suspended", "JobSuspended")]),
            [EXIT_75],
            False,
            id="job-shows-suspended",
        ),
        # Deleted at a suspension (no finalizer): not counted, so its index ran again on resume
        # and the replacement is not seen yet.
        pytest.param(_job(active=1), [SUSPEND_VICTIM], False, id="suspend-victim"),
        pytest.param(
            _job(active=1), [SUSPEND_VICTIM_DISRUPTED], False, id="suspend-victim-disrupted"
        ),
        pytest.param(
            _job(active=0, terminating=1, suspend=True),
            [SUSPEND_VICTIM],
            False,
            id="suspend-victim-job-suspended",
        ),
        pytest.param(
            _job(active=1, conditions=[cond("Suspended", "JobSuspended")]),
            [SUSPEND_VICTIM],
            False,
            id="suspend-victim-job-shows-suspended",
        ),
        # A pod on a removed node: finished, not terminal; the Job counts one more.
        pytest.param(
            _job(active=1, terminating=1, completions=2),
            [EXIT_75, ON_LOST_NODE],
            False,
            id="pod-on-lost-node",
        ),
        pytest.param(
            _job(terminating=1, completions=2),
            [EXIT_75, ON_LOST_NODE],
            True,
            id="pod-on-lost-node-counted",
        ),
        # Every index is held, but another pod seen is not terminal yet: the count decides.
        pytest.param(
            _job(terminating=2),
            [EXIT_75, make_pod("tj-a1-0-y", phase="Running", node="node-gone", deleting=True)],
            False,
            id="other-pod-not-terminal",
        ),
        pytest.param(_job(active=1, completions=None), [EXIT_75], False, id="no-completions"),
        pytest.param(_job(active=1), [_ended(index_in="x")], False, id="index-unreadable"),
        pytest.param(_job(active=1), [_ended(1)], False, id="index-out-of-range"),
        pytest.param(_job(active=1), [_ended(index_in="none")], False, id="no-index"),
    ],
)
def test_attempt_pods_finished(job: dict[str, Any] | None, pods: list[Any], finished: bool) -> None:
    assert attempt_pods_finished(job, pods, {"node-1": True}) is finished


# --------------------------------------------------------------------------- defect 8
def _with_sidecar(trainer: dict[str, Any], phase: str = "Running", **kw: Any) -> dict[str, Any]:
    pod = make_pod(phase=phase, **kw)
    pod["status"]["containerStatuses"] = [
        {"name": "trainer", "state": trainer},
        {"name": "log-shipper", "state": {"running": {}}},
    ]
    return pod


TRAINER_DONE = _with_sidecar({"terminated": {"exitCode": 0}})
TRAINER_FAILED = _with_sidecar({"terminated": {"exitCode": 1}})
TRAINER_RUNS = _with_sidecar({"running": {}})
TRAINER_DONE_DELETING = _with_sidecar({"terminated": {"exitCode": 0}}, deleting=True)


@pytest.mark.parametrize(
    ("pods", "over", "ended"),
    [
        pytest.param([TRAINER_DONE], True, [0], id="sidecar-keeps-finished-pod"),
        pytest.param([TRAINER_FAILED, TRAINER_RUNS], True, [0], id="failed-rank-with-sidecar"),
        # Rank 0 finished first: its peers may still be saving; nothing ends it yet.
        pytest.param([TRAINER_DONE, TRAINER_RUNS], False, [], id="attempt-not-over"),
        pytest.param([TRAINER_RUNS], True, [], id="trainer-still-runs"),
        pytest.param([TRAINER_DONE_DELETING], True, [], id="already-deleting"),
        pytest.param([SUCCEEDED, FAILED], True, [], id="terminal-pods"),
        pytest.param([make_pod(phase="Running", exit_code=0)], True, [], id="no-sidecar"),
    ],
)
def test_pods_to_end(pods: list[Any], over: bool, ended: list[int]) -> None:
    assert pods_to_end(pods, over) == [pods[i] for i in ended]


# --------------------------------------------------------------------------- defect 2
@pytest.mark.parametrize(
    ("status", "foreign", "reason", "fatal"),
    [
        (409, True, Reason.NAME_TAKEN, False),
        (422, False, Reason.CHILD_INVALID, True),
        (403, False, Reason.CHILD_FORBIDDEN, False),
        # Temporary: retried as any failed pass.
        (409, False, None, None),
        (500, False, None, None),
        (429, False, None, None),
        (None, False, None, None),
    ],
)
def test_create_refusal(status: int | None, foreign: bool, reason: str | None, fatal: bool) -> None:
    refusal = create_refusal("Job", "tj-a1", status, "the apiserver says no", foreign=foreign)
    if reason is None:
        assert refusal is None
        return
    assert refusal is not None
    assert (refusal.reason, refusal.fatal) == (reason, fatal)
    assert "Job tj-a1" in refusal.message and "the apiserver says no" in refusal.message


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            json.dumps({"kind": "Status", "message": 'Job.batch "x" is invalid'}),
            'Job.batch "x" is invalid',
        ),
        (b'{"message": "forbidden: exceeded quota"}', "forbidden: exceeded quota"),
        ("plain text", "plain text"),
        (None, "fallback"),
        ("{}", "fallback"),
    ],
)
def test_api_message(body: str | bytes | None, expected: str) -> None:
    assert api_message(body, "fallback") == expected


@pytest.mark.parametrize(
    ("refused_for", "wait"),
    [(0.0, REFUSAL_RETRY_MIN), (3.0, REFUSAL_RETRY_MIN), (40.0, 40.0), (1e6, REFUSAL_RETRY_MAX)],
)
def test_refusal_retry_doubles_within_bounds(refused_for: float, wait: float) -> None:
    assert refusal_retry_seconds(refused_for) == wait


def _event(reason: str, message: str, when: str) -> dict[str, Any]:
    return {"reason": reason, "message": message, "lastTimestamp": when}


QUOTA = 'Error creating: pods "tj-a1-0-x" is forbidden: exceeded quota: q, requested: pods=1'
PSA = 'Error creating: pods "tj-a1-0-x" is forbidden: violates PodSecurity "restricted:latest"'


@pytest.mark.parametrize(
    ("job", "events", "why"),
    [
        (make_job(), [], None),
        (make_job(), [_event("SuccessfulCreate", "Created pod", "2026-01-01T00:00:01Z")], None),
        (make_job(), [_event("FailedCreate", QUOTA, "2026-01-01T00:00:01Z")], QUOTA),
        (
            make_job(),
            [
                _event("FailedCreate", PSA, "2026-01-01T00:00:05Z"),
                _event("FailedCreate", QUOTA, "2026-01-01T00:00:01Z"),
            ],
            PSA,
        ),
        (make_job(conditions=[cond("ReplicaFailure", "FailedCreate", QUOTA)]), [], QUOTA),
    ],
)
def test_pods_refused(job: dict[str, Any], events: list[dict[str, Any]], why: str | None) -> None:
    assert pods_refused(job, events) == why


# --------------------------------------------------------------------------- defect 5
def _attempt_job(n: int, *conds: str, deleting: bool = False) -> dict[str, Any]:
    job = make_job(conditions=[cond(c) for c in conds])
    job["metadata"]["name"] = f"tj-a{n}"
    if deleting:
        job["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return job


@pytest.mark.parametrize(
    ("jobs", "outcomes", "up_to", "deleted", "kept"),
    [
        # The final failure (RestartsExhausted): its Job stays for its logs.
        pytest.param(
            {1: _attempt_job(1, "Failed")}, {1: "Failed"}, 1, [], 1, id="last-failed-kept"
        ),
        pytest.param(
            {1: _attempt_job(1, "FailureTarget")}, {1: "Failed"}, 1, [], 1, id="failure-target"
        ),
        # A newer failure replaces the kept one.
        pytest.param(
            {1: _attempt_job(1, "Failed"), 2: _attempt_job(2, "Failed")},
            {1: "Failed", 2: "Failed"},
            2,
            [1],
            2,
            id="newer-failure-replaces",
        ),
        # Preempted attempts' Jobs go as before; the last failure stays.
        pytest.param(
            {1: _attempt_job(1, "Failed"), 2: _attempt_job(2, "Failed")},
            {1: "Failed", 2: "Preempted"},
            2,
            [2],
            1,
            id="preempted-after-failure",
        ),
        pytest.param({1: _attempt_job(1)}, {1: "Preempted"}, 1, [1], None, id="preempted"),
        # Kueue evicted it before its pods ran: a suspended Job can be admitted again.
        pytest.param({1: _attempt_job(1)}, {1: "Failed"}, 1, [1], None, id="not-terminal"),
        pytest.param({1: _attempt_job(1, "Complete")}, {1: "Succeeded"}, 1, [], None, id="done"),
        pytest.param(
            {1: _attempt_job(1, "Failed"), 2: _attempt_job(2)},
            {1: "Failed", 2: None},
            1,
            [],
            1,
            id="current-attempt-untouched",
        ),
        pytest.param(
            {1: _attempt_job(1, deleting=True)}, {1: "Preempted"}, 1, [], None, id="deleting"
        ),
        # Records beyond the newest 20 are dropped: no outcome, deleted.
        pytest.param({1: _attempt_job(1, "Failed")}, {}, 1, [1], None, id="record-dropped"),
    ],
)
def test_failed_attempt_job_kept(
    jobs: dict[int, dict[str, Any]],
    outcomes: dict[int, str | None],
    up_to: int,
    deleted: list[int],
    kept: int | None,
) -> None:
    assert kept_failed_attempt(jobs, outcomes) == kept
    assert jobs_to_delete(jobs, outcomes, up_to) == [jobs[n] for n in deleted]


@pytest.mark.parametrize(
    ("pods", "kept"),
    [
        # The attempt is recorded as soon as its pod ended (no_pod_can_follow), before the Job
        # controller marks the Job Failed: its Job and pod stay for their logs all the same.
        pytest.param([_ended(0, exit_code=1)], 1, id="pod-ended-job-not-failed-yet"),
        pytest.param([], None, id="no-pod-seen"),
        # Deleted without the tracking finalizer (a suspension's victim): the Job may run again.
        pytest.param(
            [_ended(0, exit_code=1, tracked=False, deleting=True)], None, id="suspension-victim"
        ),
    ],
)
def test_a_failed_attempt_is_kept_once_no_pod_can_follow(
    pods: list[dict[str, Any]], kept: int | None
) -> None:
    jobs = {1: _attempt_job(1)}  # no Failed condition yet
    assert kept_failed_attempt(jobs, {1: "Failed"}, {1: pods}) == kept
    assert jobs_to_delete(jobs, {1: "Failed"}, 1, {1: pods}) == ([] if kept else [jobs[1]])


def _pod_at(name: str, index: int, created: str, **kw: Any) -> dict[str, Any]:
    pod = make_pod(name, index=index, **kw)
    pod["metadata"]["creationTimestamp"] = created
    return pod


T_OLD, T_NEW = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


@pytest.mark.parametrize(
    ("pods", "restarted"),
    [
        ([], []),
        ([_pod_at("a", 0, T_OLD)], []),  # running
        ([_pod_at("a", 0, T_OLD, phase="Failed", exit_code=75)], []),  # ended
        # suspended and resumed: index 0 ended, a later pod of it runs
        (
            [
                _pod_at("a", 0, T_OLD, phase="Failed", exit_code=75, deleting=True),
                _pod_at("b", 0, T_NEW),
            ],
            ["b"],
        ),
        # two indexes, both restarted (one still pending, unbound)
        (
            [
                _pod_at("a", 0, T_OLD, phase="Failed", exit_code=75, deleting=True),
                _pod_at("b", 1, T_OLD, phase="Failed", exit_code=75, deleting=True),
                _pod_at("c", 0, T_NEW),
                _pod_at("d", 1, T_NEW, phase="Pending", node=None),
            ],
            ["c", "d"],
        ),
        # one rank failed, the other still runs: another index, nothing restarted
        (
            [_pod_at("a", 0, T_OLD, phase="Failed", exit_code=1), _pod_at("b", 1, T_NEW)],
            [],
        ),
        # the restarted pod ended too: nothing left running (the attempt is simply over)
        (
            [
                _pod_at("a", 0, T_OLD, phase="Failed", exit_code=75, deleting=True),
                _pod_at("b", 0, T_NEW, phase="Failed", exit_code=75),
            ],
            [],
        ),
        # an ended pod created after the running one is not a restart of it
        (
            [_pod_at("a", 0, T_NEW, phase="Failed", exit_code=75), _pod_at("b", 0, T_OLD)],
            [],
        ),
    ],
)
def test_restarted_pods(pods: list[dict[str, Any]], restarted: list[str]) -> None:
    got = restarted_pods(pods, {"node-1": True})
    assert [p["metadata"]["name"] for p in got] == restarted


# ------------------------------------------------------------------------------ what children.py
# relies on in the Job render_job makes (issue 39): no_pod_can_follow, attempt_pods_finished,
# kept_failed_attempt and restarted_pods are only right for a Job of exactly this shape.
@pytest.mark.parametrize(
    "spec_fields",
    [
        {},
        {"numNodes": 4},
        {"queueName": "q"},
        # a user's podTemplate cannot loosen any of it
        {"podTemplate": {"spec": {"restartPolicy": "OnFailure", "nodeSelector": {"a": "b"}}}},
        {"podTemplate": {"metadata": {"finalizers": ["example.com/mine"]}}},
        {"failurePolicy": {"rules": [{"action": "Ignore", "onExitCodes": [3]}]}},
    ],
    ids=[
        "one-node",
        "four-nodes",
        "kueue",
        "template-restart-policy",
        "user-finalizer",
        "failure-policy-ignore",
    ],
)
def test_render_job_keeps_what_children_relies_on(spec_fields: dict[str, Any]) -> None:
    spec = make_spec(**spec_fields)
    params = render.AttemptParams(
        attempt=2, grace_seconds=60, resume_from="latest", suspended=bool(spec.queue_name)
    )
    job = render.render_job({"name": "tj", "namespace": "ns", "uid": "u"}, spec, params)
    js = job["spec"]
    # One pod per index, every index once: a completion index identifies a pod's place.
    assert js["completionMode"] == "Indexed"
    assert js["completions"] == js["parallelism"] == spec.num_nodes
    # A counted failure fails the whole attempt: no retries inside a Job.
    assert js["backoffLimit"] == 0
    assert "backoffLimitPerIndex" not in js and "maxFailedIndexes" not in js
    # A replacement only after the old pod is Failed (never beside one still saving).
    assert js["podReplacementPolicy"] == "Failed"
    # FailJob on the runtime's preemption exit and on a disruption; no Ignore or Count rule
    # (an ignored failure would give an index a second pod: restarted_pods, no_pod_can_follow).
    rules = js["podFailurePolicy"]["rules"]
    assert {r["action"] for r in rules} == {"FailJob"}
    exits = [r["onExitCodes"] for r in rules if "onExitCodes" in r]
    assert exits == [{"containerName": CONTAINER_NAME, "operator": "In", "values": [75]}]
    assert [r["onPodConditions"] for r in rules if "onPodConditions" in r] == [
        [{"type": "DisruptionTarget"}]
    ]
    assert "successPolicy" not in js  # an index succeeds only by its own pod
    pod = js["template"]
    assert pod["spec"]["restartPolicy"] == "Never"  # a container never restarts in place
    # The attempt-record finalizer keeps an ended pod (its termination message) until recorded.
    assert ATTEMPT_FINALIZER in pod["metadata"]["finalizers"]
    assert CONTAINER_NAME in [c["name"] for c in pod["spec"]["containers"]]
    assert js["suspend"] is bool(spec.queue_name)  # Kueue admits it by unsuspending


def test_held_pods() -> None:
    held = make_pod("held")
    held["metadata"]["finalizers"] = ["other", render.ATTEMPT_FINALIZER]
    released = make_pod("released")
    released["metadata"]["finalizers"] = ["other"]
    got = held_pods({1: [released, held], 2: [make_pod("bare")]})
    assert [p["metadata"]["name"] for p in got] == ["held"]
