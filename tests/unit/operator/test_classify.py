"""classify_interruption tells success, the kinds of preemption and real failures apart."""

from __future__ import annotations

from typing import Any

import pytest

from preemptible_operator.classify import (
    DEACTIVATED_BY_OPERATOR_ANNOTATION,
    attempt_started,
    classify_interruption,
    container_end,
    killed_at_grace,
    kubelet_eviction,
    pending_detail,
    pod_finished,
    pod_sigterm_to_exit,
)
from preemptible_operator.conditions import Reason
from tests.unit.operator.builders import cond, make_job, make_pod
from trainer_runtime import protocol

PREEMPTED_MSG = protocol.TerminationMessage(
    reason="preempted",
    step=12,
    checkpoint="/c/checkpoint-12",
    complete=True,
    sigterm_to_exit_seconds=4.5,
).model_dump_json()


def _wl(*conds: dict[str, Any], active: bool | None = None, ours: bool = False) -> dict[str, Any]:
    wl: dict[str, Any] = {"metadata": {"name": "wl"}, "status": {"conditions": list(conds)}}
    if active is not None:
        wl["spec"] = {"active": active}
    if ours:
        wl["metadata"]["annotations"] = {DEACTIVATED_BY_OPERATOR_ANNOTATION: "true"}
    return wl


# Kubelet messages (facts from the kubelet's eviction manager and node shutdown manager).
EMPTYDIR_MSG = 'Usage of EmptyDir volume "scratch" exceeds the limit "1Gi". '
PRESSURE_MSG = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 80Mi. "
SHUTDOWN_MSG = "Pod was terminated in response to imminent node shutdown."


def _status(pod: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    pod["status"]["reason"] = reason
    pod["status"]["message"] = message
    return pod


def _oom(pod: dict[str, Any]) -> dict[str, Any]:
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] = "OOMKilled"
    return pod


def _stopped(
    pod: dict[str, Any], finished: str = "2026-01-01T10:00:30Z", grace: int = 30
) -> dict[str, Any]:
    """Deleted at 10:00:00 with ``grace`` seconds (deletionTimestamp 10:00:30), its container
    ended at ``finished`` (by default at the deadline)."""
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T10:00:30Z"
    pod["metadata"]["deletionGracePeriodSeconds"] = grace
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = finished
    return pod


def _unknown(pod: dict[str, Any]) -> dict[str, Any]:
    """The kubelet after a node reboot: the container it no longer finds."""
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    terminated["reason"] = "ContainerStatusUnknown"
    terminated["message"] = "The container could not be located when the pod was terminated"
    return pod


CASES = [
    # (id, job, pods, workload, kwargs, outcome, reason)
    ("running", make_job(), [make_pod()], None, {}, "Active", Reason.STARTED),
    (
        "complete-condition",
        make_job(conditions=[cond("Complete")]),
        [],
        None,
        {},
        "Succeeded",
        Reason.COMPLETED,
    ),
    (
        "all-ranks-exit-0",
        make_job(completions=2),
        [
            make_pod("a", index=0, phase="Succeeded", exit_code=0),
            make_pod("b", index=1, phase="Succeeded", exit_code=0),
        ],
        None,
        {},
        "Succeeded",
        Reason.COMPLETED,
    ),
    (
        "one-of-two-done",
        make_job(completions=2),
        [make_pod("a", phase="Succeeded", exit_code=0), make_pod("b", index=1)],
        None,
        {},
        "Active",
        Reason.STARTED,
    ),
    (
        "kueue-preempted",
        make_job(suspend=True),
        [make_pod(deleting=True)],
        _wl(cond("Evicted", "Preempted", "preempted by high")),
        {},
        "Preempted",
        Reason.KUEUE_PREEMPTED,
    ),
    (
        "kueue-preempted-condition",
        make_job(suspend=True),
        [],
        _wl(cond("Preempted", "InClusterQueue")),
        {},
        "Preempted",
        Reason.KUEUE_PREEMPTED,
    ),
    (
        # Its pods never ran (a bad image under waitForPodsReady): a failure, so backoff and
        # maxRestarts apply instead of an immediate requeue forever.
        "kueue-evicted-before-it-ran",
        make_job(suspend=True),
        [],
        _wl(cond("Evicted", "PodsReadyTimeout")),
        {},
        "Failed",
        Reason.PODS_NEVER_READY,
    ),
    (
        "kueue-evicted-admission-check-before-it-ran",
        make_job(suspend=True),
        [],
        _wl(cond("Evicted", "AdmissionCheck")),
        {},
        "Failed",
        Reason.PODS_NEVER_READY,
    ),
    (
        "kueue-evicted-after-it-ran",
        make_job(suspend=True),
        [],
        _wl(cond("Evicted", "PodsReadyTimeout")),
        {"was_admitted": True, "was_started": True},
        "Preempted",
        Reason.KUEUE_EVICTED,
    ),
    (
        # 15 of 16 pods ran, one stayed unschedulable: admitted, never started. A start
        # failure (backoff, maxRestarts), not a preemption requeued at once forever.
        "kueue-podsreadytimeout-after-some-pods-ran",
        make_job(suspend=True, completions=16),
        [make_pod(f"p{i}", index=i, phase="Failed", exit_code=75) for i in range(15)]
        + [make_pod("p15", index=15, phase="Pending", node=None)],
        _wl(cond("Evicted", "PodsReadyTimeout")),
        {"was_admitted": True, "was_started": False},
        "Failed",
        Reason.PODS_NEVER_READY,
    ),
    (
        # An administrator's deactivation: respected (TrainingJob suspended), never undone by
        # a fresh Workload.
        "workload-deactivated-by-admin",
        make_job(suspend=True),
        [make_pod(phase="Failed", exit_code=75, message=PREEMPTED_MSG)],
        _wl(cond("Evicted", "InactiveWorkload", "The workload is deactivated"), active=False),
        {"was_admitted": True, "was_started": True},
        "Suspended",
        Reason.WORKLOAD_DEACTIVATED,
    ),
    (
        # Kueue's own deactivation at its requeuing limit (newer Kueue: reason Deactivated).
        "workload-deactivated-by-kueue-requeuing-limit",
        make_job(suspend=True),
        [],
        _wl(cond("Evicted", "Deactivated", "exceeding the maximum number of re-queuing retries")),
        {"was_admitted": True},
        "Suspended",
        Reason.WORKLOAD_DEACTIVATED,
    ),
    (
        # Deactivated by an administrator after Kueue had preempted it (Kueue keeps the
        # Preempted eviction reason).
        "workload-deactivated-after-preemption",
        make_job(suspend=True),
        [],
        _wl(cond("Evicted", "Preempted"), active=False),
        {"was_admitted": True, "was_started": True},
        "Suspended",
        Reason.WORKLOAD_DEACTIVATED,
    ),
    (
        "workload-deactivated-beats-user-suspend",
        make_job(suspend=True),
        [],
        _wl(cond("Evicted", "InactiveWorkload"), active=False),
        {"user_suspended": True},
        "Suspended",
        Reason.WORKLOAD_DEACTIVATED,
    ),
    (
        # The operator's own deactivation after Kueue's preemption is no administrator's.
        "workload-deactivated-by-the-operator",
        make_job(suspend=True),
        [],
        _wl(cond("Evicted", "Preempted"), active=False, ours=True),
        {"was_admitted": True, "was_started": True},
        "Preempted",
        Reason.KUEUE_PREEMPTED,
    ),
    (
        "suspended-after-admission-no-workload",
        make_job(suspend=True),
        [],
        None,
        {"was_admitted": True},
        "Preempted",
        Reason.KUEUE_EVICTED,
    ),
    (
        "queued-never-admitted",
        make_job(suspend=True),
        [],
        _wl(cond("QuotaReserved", status="False")),
        {},
        "Active",
        Reason.STARTED,
    ),
    (
        "eviction-api",
        make_job(),
        [
            make_pod(
                phase="Failed",
                exit_code=75,
                message=PREEMPTED_MSG,
                conditions=[cond("DisruptionTarget", "EvictionByEvictionAPI")],
            )
        ],
        None,
        {},
        "Preempted",
        Reason.POD_EVICTED,
    ),
    (
        "scheduler-preemption",
        make_job(),
        [make_pod(conditions=[cond("DisruptionTarget", "PreemptionByScheduler")])],
        None,
        {},
        "Preempted",
        Reason.SCHEDULER_PREEMPTED,
    ),
    (
        "taint-manager",
        make_job(),
        [make_pod(conditions=[cond("DisruptionTarget", "DeletionByTaintManager")])],
        None,
        {},
        "Preempted",
        Reason.NODE_LOST,
    ),
    (
        "kubelet-shutdown",
        make_job(),
        [make_pod(conditions=[cond("DisruptionTarget", "TerminationByKubelet")])],
        None,
        {},
        "Preempted",
        Reason.NODE_SHUTDOWN,
    ),
    (
        "kubelet-graceful-node-shutdown",
        make_job(),
        [
            _status(
                make_pod(
                    phase="Failed",
                    exit_code=75,
                    message=PREEMPTED_MSG,
                    conditions=[cond("DisruptionTarget", "TerminationByKubelet", SHUTDOWN_MSG)],
                ),
                "Terminated",
                SHUTDOWN_MSG,
            )
        ],
        None,
        {},
        "Preempted",
        Reason.NODE_SHUTDOWN,
    ),
    (
        # An emptyDir over its sizeLimit: evicted at once (grace 0), and again in every
        # attempt. A failure (maxRestarts), never a preemption requeued forever.
        "kubelet-emptydir-sizelimit-eviction",
        make_job(),
        [
            _status(
                make_pod(
                    phase="Failed",
                    exit_code=137,
                    conditions=[cond("DisruptionTarget", "TerminationByKubelet", EMPTYDIR_MSG)],
                ),
                "Evicted",
                EMPTYDIR_MSG,
            )
        ],
        None,
        {},
        "Failed",
        Reason.KUBELET_EVICTED,
    ),
    (
        "kubelet-memory-pressure-eviction-condition-only",
        make_job(),
        [make_pod(conditions=[cond("DisruptionTarget", "TerminationByKubelet", PRESSURE_MSG)])],
        None,
        {},
        "Failed",
        Reason.KUBELET_EVICTED,
    ),
    (
        "node-not-ready",
        make_job(),
        [make_pod(node="n1")],
        None,
        {"node_ready": {"n1": False}},
        "Preempted",
        Reason.NODE_LOST,
    ),
    (
        "node-gone",
        make_job(),
        [make_pod(node="n1")],
        None,
        {"node_ready": {}},
        "Preempted",
        Reason.NODE_LOST,
    ),
    (
        # A real crash reported while its node's heartbeat lapsed: the crash counts.
        "crash-beats-not-ready-node",
        make_job(),
        [make_pod(node="n1", exit_code=1, message="Traceback ... ValueError: boom")],
        None,
        {"node_ready": {"n1": False}},
        "Failed",
        Reason.TRAINING_FAILED,
    ),
    (
        "crash-of-one-rank-beats-not-ready-node-of-another",
        make_job(completions=2),
        [
            make_pod("a", index=0, node="n1"),
            make_pod("b", index=1, node="n2", phase="Failed", exit_code=1, message="boom"),
        ],
        None,
        {"node_ready": {"n1": False, "n2": True}},
        "Failed",
        Reason.TRAINING_FAILED,
    ),
    (
        "oom-beats-not-ready-node",
        make_job(),
        [_oom(make_pod(node="n1", phase="Failed", exit_code=137))],
        None,
        {"node_ready": {"n1": False}},
        "Failed",
        Reason.OOM_KILLED,
    ),
    (
        # A rank that stopped because its peer's node went away is no crash of its own.
        "peer-gone-on-not-ready-node-stays-node-lost",
        make_job(completions=2),
        [
            make_pod("a", index=0, node="n1"),
            make_pod("b", index=1, node="n2", phase="Failed", exit_code=69),
        ],
        None,
        {"node_ready": {"n1": False, "n2": True}},
        "Preempted",
        Reason.NODE_LOST,
    ),
    (
        # After a node reboot: ContainerStatusUnknown, exit 137, no deletion. The node lost
        # the attempt: a preemption, not a failure (and no grace to double).
        "container-status-unknown-after-node-reboot",
        make_job(),
        [_unknown(make_pod(phase="Failed", exit_code=137))],
        None,
        {"node_ready": {"node-1": True}},
        "Preempted",
        Reason.NODE_LOST,
    ),
    (
        "crash-beats-container-status-unknown",
        make_job(completions=2),
        [
            _unknown(make_pod("a", index=0, phase="Failed", exit_code=137)),
            make_pod("b", index=1, phase="Failed", exit_code=1, message="boom"),
        ],
        None,
        {},
        "Failed",
        Reason.TRAINING_FAILED,
    ),
    (
        "pod-unknown",
        make_job(),
        [make_pod(phase="Unknown")],
        None,
        {},
        "Preempted",
        Reason.NODE_LOST,
    ),
    (
        "runtime-exit-75",
        make_job(),
        [make_pod(phase="Failed", exit_code=75, message=PREEMPTED_MSG)],
        None,
        {},
        "Preempted",
        Reason.RUNTIME_PREEMPTED,
    ),
    (
        "sigkill-after-eviction",
        make_job(),
        [
            make_pod(
                phase="Failed",
                exit_code=137,
                conditions=[cond("DisruptionTarget", "EvictionByEvictionAPI")],
            )
        ],
        None,
        {},
        "Preempted",
        Reason.POD_EVICTED,
    ),
    (
        "real-failure",
        make_job(),
        [make_pod(phase="Failed", exit_code=1, message="Traceback ... ValueError: boom")],
        None,
        {},
        "Failed",
        Reason.TRAINING_FAILED,
    ),
    (
        "oom-without-disruption",
        make_job(),
        [make_pod(phase="Failed", exit_code=137)],
        None,
        {},
        "Failed",
        Reason.TRAINING_FAILED,
    ),
    (
        "job-failed-no-pods",
        make_job(conditions=[cond("Failed", "DeadlineExceeded")]),
        [],
        None,
        {},
        "Failed",
        Reason.JOB_FAILED,
    ),
    (
        "user-suspend",
        make_job(),
        [make_pod()],
        None,
        {"user_suspended": True},
        "Suspended",
        Reason.SUSPENDED,
    ),
    (
        "success-beats-suspend",
        make_job(conditions=[cond("Complete")]),
        [],
        None,
        {"user_suspended": True},
        "Succeeded",
        Reason.COMPLETED,
    ),
    (
        "kueue-beats-exit-code",
        make_job(suspend=True),
        [make_pod(phase="Failed", exit_code=75, message=PREEMPTED_MSG)],
        _wl(cond("Evicted", "Preempted")),
        {},
        "Preempted",
        Reason.KUEUE_PREEMPTED,
    ),
    (
        "disruption-beats-crash-of-other-rank",
        make_job(completions=2),
        [
            make_pod(
                "a",
                phase="Failed",
                exit_code=75,
                conditions=[cond("DisruptionTarget", "EvictionByEvictionAPI")],
            ),
            make_pod("b", index=1, phase="Failed", exit_code=1),
        ],
        None,
        {},
        "Preempted",
        Reason.POD_EVICTED,
    ),
]


@pytest.mark.parametrize(
    ("job", "pods", "workload", "kwargs", "outcome", "reason"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_classify(
    job: dict[str, Any],
    pods: list[dict[str, Any]],
    workload: dict[str, Any] | None,
    kwargs: dict[str, Any],
    outcome: str,
    reason: str,
) -> None:
    result = classify_interruption(job, pods, workload, **kwargs)
    assert (result.outcome, result.reason) == (outcome, reason), result.message
    assert result.over is (outcome != "Active")


def test_failure_message_carries_the_error() -> None:
    result = classify_interruption(
        make_job(), [make_pod(phase="Failed", exit_code=1, message="ValueError: boom")]
    )
    assert "exited 1" in result.message and "boom" in result.message


def test_container_end_parses_the_termination_message() -> None:
    end = container_end(make_pod(phase="Failed", exit_code=75, message=PREEMPTED_MSG, grace=9))
    assert end is not None and end.message is not None
    assert (end.exit_code, end.message.step, end.message.sigterm_to_exit_seconds) == (75, 12, 4.5)
    assert end.grace_seconds == 9 and not end.killed
    killed = container_end(
        _stopped(make_pod(phase="Failed", exit_code=137, message="some log tail"))
    )
    assert killed is not None and killed.killed and killed.message is None
    assert container_end(make_pod()) is None


DELETED = 1767225600.0  # make_pod's deletionTimestamp, 2026-01-01T00:00:00Z


@pytest.mark.parametrize(
    ("pod", "node_ready", "now", "finished"),
    [
        (make_pod(), None, None, False),
        (make_pod(phase="Failed", exit_code=75), None, None, True),
        (make_pod(phase="Succeeded", exit_code=0), None, None, True),
        (make_pod(deleting=True), {"node-1": True}, DELETED + 3600, False),
        # Deleted on a NotReady node that still exists: its kubelet may be partitioned, not
        # dead, never have seen the deletion and still run the pod (and write checkpoints):
        # not finished however long ago the deadline passed; once the node is gone, finished.
        (make_pod(deleting=True), {"node-1": False}, None, False),
        (make_pod(deleting=True), {"node-1": False}, DELETED, False),
        (make_pod(deleting=True), {"node-1": False}, DELETED + 30 * 86400, False),
        (make_pod(deleting=True), {}, DELETED, True),  # node gone
        (make_pod(), {}, DELETED, False),  # node gone, not deleted yet: the pod GC will
        (make_pod(deleting=True, node=None, phase="Pending"), None, None, True),
        (make_pod(phase="Pending", node=None), None, None, False),
        (make_pod(phase="Running", exit_code=75), None, None, True),  # terminated, phase not yet
    ],
)
def test_pod_finished(
    pod: dict[str, Any], node_ready: dict[str, bool] | None, now: float | None, finished: bool
) -> None:
    assert pod_finished(pod, node_ready, now) is finished


def _waiting(pod: dict[str, Any], reason: str, message: str) -> dict[str, Any]:
    waiting = {"reason": reason, "message": message} if message else {"reason": reason}
    pod["status"]["containerStatuses"] = [{"name": "trainer", "state": {"waiting": waiting}}]
    return pod


@pytest.mark.parametrize(
    ("pods", "outcome", "reason", "culprit"),
    [
        # Exit 137 from the OOM killer is a failure with its own reason, not a grace problem.
        ([_oom(make_pod(phase="Failed", exit_code=137))], "Failed", "OOMKilled", "tj-a1-0-x"),
        # Rank 1 failed for real; rank 0 was killed while it waited for it: rank 1 is the cause.
        (
            [
                make_pod("r0", index=0, phase="Failed", exit_code=137),
                make_pod("r1", index=1, phase="Failed", exit_code=1, message="CUDA error"),
            ],
            "Failed",
            "TrainingFailed",
            "r1",
        ),
        (
            [
                make_pod("r0", index=0, phase="Failed", exit_code=137),
                _oom(make_pod("r1", index=1, phase="Failed", exit_code=137)),
            ],
            "Failed",
            "OOMKilled",
            "r1",
        ),
        # The runtime's EXIT_PEER_FAILED (69) points at another rank: that one is named.
        (
            [
                make_pod("r0", index=0, phase="Failed", exit_code=69, message="rank 1 is gone"),
                make_pod("r1", index=1, phase="Failed", exit_code=1, message="CUDA error"),
            ],
            "Failed",
            "TrainingFailed",
            "r1",
        ),
        (
            [
                make_pod("r0", index=0, phase="Failed", exit_code=69, message="rank 1 is gone"),
                make_pod("r1", index=1, phase="Failed", exit_code=137),
            ],
            "Failed",
            "TrainingFailed",
            "r1",
        ),
    ],
)
def test_oom_and_the_failing_rank_are_named(
    pods: list[dict[str, Any]], outcome: str, reason: str, culprit: str
) -> None:
    result = classify_interruption(make_job(completions=len(pods)), pods)
    assert (result.outcome, result.reason) == (outcome, reason)
    assert f"pod {culprit} " in result.message


@pytest.mark.parametrize(
    ("exits", "oom", "killed"),
    [
        ([137], False, True),  # SIGKILLed at the grace deadline
        ([137], True, False),  # the OOM killer: says nothing about the grace period
        ([75, 137], False, True),  # one rank saved in time, one did not
        ([1, 137], False, False),  # a peer failed for real: the other was killed waiting
        ([1, 69], False, False),  # a peer failed for real: the other noticed and exited
        ([69, 137], False, True),  # one rank killed at the deadline, the other noticed it
        ([69, 69], False, False),
        ([75, 75], False, False),
        ([0], False, False),
    ],
)
def test_killed_at_grace(exits: list[int], oom: bool, killed: bool) -> None:
    pods = [
        _stopped(make_pod(f"r{i}", index=i, phase="Failed", exit_code=c))
        for i, c in enumerate(exits)
    ]
    if oom:
        _oom(pods[0])
    ends = [e for e in (container_end(p) for p in pods) if e is not None]
    assert killed_at_grace(ends) is killed


@pytest.mark.parametrize(
    ("pods", "detail"),
    [
        ([make_pod(phase="Pending", node=None)], None),
        (
            [
                make_pod(
                    phase="Pending",
                    node=None,
                    conditions=[
                        cond(
                            "PodScheduled",
                            "Unschedulable",
                            "pod has unbound immediate PersistentVolumeClaims",
                            status="False",
                        )
                    ],
                )
            ],
            "pod tj-a1-0-x: Unschedulable: pod has unbound immediate PersistentVolumeClaims",
        ),
        (
            [_waiting(make_pod(phase="Pending"), "ImagePullBackOff", "Back-off pulling image")],
            "pod tj-a1-0-x: ImagePullBackOff: Back-off pulling image",
        ),
        (
            [_waiting(make_pod(phase="Pending"), "CreateContainerConfigError", "secret missing")],
            "pod tj-a1-0-x: CreateContainerConfigError: secret missing",
        ),
        ([_waiting(make_pod(phase="Pending"), "ContainerCreating", "")], None),
    ],
)
def test_pending_detail_says_why_pods_do_not_run(
    pods: list[dict[str, Any]], detail: str | None
) -> None:
    assert pending_detail(pods) == detail


# ---------------------------------------------------- pods of several processes (numProcPerNode)


def _msg(reason: str = "preempted", **extra: Any) -> str:
    defaults: dict[str, Any] = {}
    if reason == "preempted":
        defaults = {"checkpoint": "/c/checkpoint-12", "complete": True}
    return protocol.TerminationMessage(
        reason=reason, step=12, **{**defaults, **extra}
    ).model_dump_json()  # type: ignore[arg-type]


PEER_GONE = _msg("failed", peer_gone=True, failed_rank=3, message="rank 0: rank 3 is gone")


@pytest.mark.parametrize(
    ("exits", "outcome", "reason", "culprit"),
    [
        # Our launcher: 75 from the pod, one message for all its workers.
        ([(75, _msg()), (75, _msg())], "Preempted", Reason.RUNTIME_PREEMPTED, None),
        # Plain torchrun exits 1 after its workers' exit 75; accelerate launch 143 when
        # signalled: the complete JIT message of local rank 0 says what happened.
        ([(1, _msg()), (1, _msg())], "Preempted", Reason.RUNTIME_PREEMPTED, None),
        ([(143, _msg()), (75, _msg())], "Preempted", Reason.RUNTIME_PREEMPTED, None),
        # ... an incomplete one does not.
        ([(1, _msg(complete=False)), (1, None)], "Failed", Reason.TRAINING_FAILED, None),
        # A real failure in any pod wins over a preemption message elsewhere.
        ([(1, _msg()), (1, _msg("failed", message="boom"))], "Failed",
         Reason.TRAINING_FAILED, "r1"),
        # Under plain torchrun a pod whose worker saw a peer gone exits 1 with that message:
        # the pod with the real failure is named first.
        ([(1, PEER_GONE), (1, _msg("failed", message="RuntimeError: boom"))], "Failed",
         Reason.TRAINING_FAILED, "r1"),
        ([(139, _msg("failed", message="local rank 1 (rank 1) exited 139")),
          (69, PEER_GONE)], "Failed", Reason.TRAINING_FAILED, "r0"),
    ],
)  # fmt: skip
def test_launcher_exit_codes(
    exits: list[tuple[int, str | None]], outcome: str, reason: str, culprit: str | None
) -> None:
    pods = [
        make_pod(f"r{i}", index=i, phase="Failed", exit_code=code, message=message)
        for i, (code, message) in enumerate(exits)
    ]
    result = classify_interruption(make_job(completions=len(pods)), pods)
    assert (result.outcome, result.reason) == (outcome, reason), result
    if culprit is not None:
        assert f"pod {culprit} " in result.message, result


@pytest.mark.parametrize(
    ("exits", "killed"),
    [
        # The workers of a pod SIGKILLed after its SIGTERM (our launcher's 137): grace too short.
        ([(137, _msg(complete=False)), (75, _msg())], True),
        # A worker crashed (our launcher: its code and reason failed): not the grace's fault.
        ([(137, _msg("failed", message="local rank 1 (rank 1) exited 137")), (69, PEER_GONE)],
         False),
        ([(139, _msg("failed")), (137, None)], False),
        # Plain torchrun after a complete save: exit 1 is no failure; the other pod's SIGKILL
        # still says the grace was short.
        ([(1, _msg()), (137, None)], True),
        ([(1, PEER_GONE), (137, None)], True),
        ([(1, _msg()), (1, _msg())], False),
    ],
)  # fmt: skip
def test_killed_at_grace_with_launchers(exits: list[tuple[int, str | None]], killed: bool) -> None:
    pods = [
        _stopped(make_pod(f"r{i}", index=i, phase="Failed", exit_code=c, message=m))
        for i, (c, m) in enumerate(exits)
    ]
    ends = [e for e in (container_end(p) for p in pods) if e is not None]
    assert killed_at_grace(ends) is killed


def _deleted(pod: dict[str, Any], deletion: str | None, grace: int | None, finished: str) -> Any:
    if deletion is not None:
        pod["metadata"]["deletionTimestamp"] = deletion
    if grace is not None:
        pod["metadata"]["deletionGracePeriodSeconds"] = grace
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = finished
    return pod


@pytest.mark.parametrize(
    ("deletion", "grace", "finished", "seconds"),
    [
        # Deleted at 10:00:00 with 30 s of grace (deletionTimestamp 10:00:30), ended 10:00:07.
        ("2026-01-01T10:00:30Z", 30, "2026-01-01T10:00:07Z", 7.0),
        ("2026-01-01T10:00:30Z", 30, "2026-01-01T10:00:30Z", 30.0),
        # It ended before anyone deleted it (its own exit, then the Job's clean-up).
        ("2026-01-01T10:00:30Z", 30, "2026-01-01T09:59:58Z", None),
        (None, None, "2026-01-01T10:00:07Z", None),  # never deleted
        ("2026-01-01T10:00:30Z", None, "2026-01-01T10:00:07Z", None),
    ],
)
def test_pod_sigterm_to_exit(
    deletion: str | None, grace: int | None, finished: str, seconds: float | None
) -> None:
    pod = _deleted(make_pod(phase="Failed", exit_code=1), deletion, grace, finished)
    assert pod_sigterm_to_exit(pod) == seconds


@pytest.mark.parametrize(
    ("message_seconds", "observed", "expected"),
    [(4.5, "2026-01-01T10:00:07Z", 7.0), (4.5, "2026-01-01T10:00:04Z", 4.5), (None, None, None)],
)
def test_sigterm_to_exit_is_the_longer_of_message_and_pod(
    message_seconds: float | None, observed: str | None, expected: float | None
) -> None:
    """Plain torchrun: rank 0 measured 4.5 s inside its worker; the pod ended 7 s after its
    SIGTERM (torchrun's teardown of the other workers): 7 s is the ground truth."""
    message = _msg(sigterm_to_exit_seconds=message_seconds)
    pod = make_pod(phase="Failed", exit_code=1, message=message)
    if observed is not None:
        _deleted(pod, "2026-01-01T10:00:30Z", 30, observed)
    end = container_end(pod)
    assert end is not None and end.sigterm_to_exit == expected


# --------------------------------------------------------- a SIGKILL that says the grace was short


def _disrupted(pod: dict[str, Any], reason: str, since: str, finished: str) -> dict[str, Any]:
    condition = cond("DisruptionTarget", reason)
    condition["lastTransitionTime"] = since
    pod["status"]["conditions"] = [condition]
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = finished
    return pod


@pytest.mark.parametrize(
    ("pod", "killed"),
    [
        # Deleted (Kueue, the Eviction API, the user's suspend) and killed at its deadline.
        (_stopped(make_pod(phase="Failed", exit_code=137)), True),
        (_stopped(make_pod(phase="Failed", exit_code=137), finished="2026-01-01T10:00:29Z"), True),
        # Killed well before the deadline of its deletion: someone else's SIGKILL.
        (_stopped(make_pod(phase="Failed", exit_code=137), finished="2026-01-01T10:00:10Z"), False),
        # Nobody asked it to stop (no deletion, no DisruptionTarget): not the grace's fault.
        (make_pod(phase="Failed", exit_code=137), False),
        # After a node reboot: ContainerStatusUnknown/137, no deletion.
        (_unknown(make_pod(phase="Failed", exit_code=137)), False),
        (_unknown(_stopped(make_pod(phase="Failed", exit_code=137))), False),
        # The kubelet's own termination (no deletion): its condition's time plus the grace.
        (
            _disrupted(
                make_pod(phase="Failed", exit_code=137),
                "TerminationByKubelet",
                "2026-01-01T10:00:00Z",
                "2026-01-01T10:00:30Z",
            ),
            True,
        ),
        (
            _disrupted(
                make_pod(phase="Failed", exit_code=137),
                "TerminationByKubelet",
                "2026-01-01T10:00:00Z",
                "2026-01-01T10:00:05Z",
            ),
            False,
        ),
        # A kubelet eviction (grace 0 or the kubelet's maximum): never the pod's grace.
        (
            _status(
                _disrupted(
                    make_pod(phase="Failed", exit_code=137),
                    "TerminationByKubelet",
                    "2026-01-01T10:00:00Z",
                    "2026-01-01T10:00:30Z",
                ),
                "Evicted",
                EMPTYDIR_MSG,
            ),
            False,
        ),
    ],
)
def test_sigkill_is_a_grace_kill_only_at_the_deadline_of_a_requested_stop(
    pod: dict[str, Any], killed: bool
) -> None:
    end = container_end(pod)
    assert end is not None and end.killed is killed
    assert killed_at_grace([end]) is killed


@pytest.mark.parametrize(
    ("status_reason", "status_message", "condition", "evicted"),
    [
        ("Evicted", EMPTYDIR_MSG, None, True),
        ("Evicted", PRESSURE_MSG, ("TerminationByKubelet", PRESSURE_MSG), True),
        (
            "Evicted",
            "Pod ephemeral local storage usage exceeds the total limit of containers 2Gi. ",
            None,
            True,
        ),
        (None, None, ("TerminationByKubelet", EMPTYDIR_MSG), True),
        ("Terminated", SHUTDOWN_MSG, ("TerminationByKubelet", SHUTDOWN_MSG), False),
        (None, None, ("TerminationByKubelet", ""), False),
        (None, None, ("EvictionByEvictionAPI", "Eviction API: evicting"), False),
        (None, None, None, False),
    ],
)
def test_kubelet_eviction(
    status_reason: str | None,
    status_message: str | None,
    condition: tuple[str, str] | None,
    evicted: bool,
) -> None:
    conditions = [cond("DisruptionTarget", *condition)] if condition else []
    pod = make_pod(phase="Failed", exit_code=137, conditions=conditions)
    if status_reason:
        _status(pod, status_reason, status_message or "")
    message = kubelet_eviction(pod)
    assert (message is not None) is evicted
    if evicted:
        assert message == (status_message or condition[1])  # type: ignore[index]


def _ready(pod: dict[str, Any], status: str = "True") -> dict[str, Any]:
    pod["status"]["conditions"] = [cond("Ready", status=status)]
    return pod


@pytest.mark.parametrize(
    ("pods", "expected", "started"),
    [
        ([_ready(make_pod("a", index=0)), _ready(make_pod("b", index=1))], 2, True),
        # 15 of 16 running, one unschedulable: not started.
        (
            [_ready(make_pod(f"p{i}", index=i)) for i in range(15)]
            + [make_pod("p15", index=15, phase="Pending", node=None)],
            16,
            False,
        ),
        ([_ready(make_pod("a", index=0)), _ready(make_pod("b", index=1), "False")], 2, False),
        ([_ready(make_pod("a", index=0)), _ready(make_pod("b", index=1, deleting=True))], 2, False),
        # Two pods of the same index (a replacement) are one rank.
        ([_ready(make_pod("a", index=0)), _ready(make_pod("a2", index=0))], 2, False),
        ([make_pod("a", index=0)], 1, True),  # no Ready condition reported yet: Running counts
        ([], 1, False),
    ],
)
def test_attempt_started_needs_all_pods_running_together(
    pods: list[dict[str, Any]], expected: int, started: bool
) -> None:
    assert attempt_started(pods, expected) is started
