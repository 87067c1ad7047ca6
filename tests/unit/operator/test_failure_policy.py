"""spec.failurePolicy (rules by exit code and reason, maxRestarts in a window) and the escalation of
pods stuck on a NotReady node (issue 30)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import kubernetes
import pytest
from pydantic import ValidationError

from preemptible_operator import conditions as cond
from preemptible_operator import models
from preemptible_operator.classify import Interruption, classify_interruption, container_end
from preemptible_operator.conditions import Reason
from preemptible_operator.failure_policy import (
    MAX_FAILURE_TIMES,
    FailureVerdict,
    counted_failures,
    decide_failure,
    keep_failure_times,
)
from preemptible_operator.phases import PhaseInputs, next_phase
from preemptible_operator.reconcile import OperatorConfig, PassResult, Reconciler, _Observed
from preemptible_operator.timestamps import parse_rfc3339
from preemptible_operator.unreachable import (
    OUT_OF_SERVICE_TAINT,
    stuck_on_unreachable_nodes,
    unreachable_condition,
)
from tests.unit.operator.builders import make_job, make_pod, make_spec
from trainer_runtime import protocol

POLICY = models.FailurePolicySpec.model_validate(
    {
        "rules": [
            {"name": "bad-config", "action": "FailJob", "onExitCodes": [2]},
            {"action": "Ignore", "onReasons": ["KubeletEvicted"]},
            {"name": "flaky-nccl", "action": "Ignore", "onExitCodes": [134, 139]},
            {"name": "oom", "action": "FailJob", "onReasons": ["OOMKilled"], "onExitCodes": [137]},
            {"name": "other-oom", "action": "Restart", "onReasons": ["OOMKilled"]},
        ]
    }
)

DECISIONS = [
    # Only real failures reach the rules: a preemption or suspension is never matched, whatever
    # its reason or exit codes (the preemption contract).
    ("preempted-exit-75", "Preempted", Reason.RUNTIME_PREEMPTED, [75], POLICY, None),
    ("kueue-preempted", "Preempted", Reason.KUEUE_PREEMPTED, [], POLICY, None),
    ("node-lost-exit-2", "Preempted", Reason.NODE_LOST, [2], POLICY, None),
    ("suspended", "Suspended", Reason.SUSPENDED, [], POLICY, None),
    ("succeeded", "Succeeded", Reason.COMPLETED, [0], POLICY, None),
    # No policy, or no matching rule: Restart (today's behaviour).
    ("no-policy", "Failed", Reason.TRAINING_FAILED, [1], None, FailureVerdict("Restart")),
    ("no-rules", "Failed", Reason.TRAINING_FAILED, [1], models.FailurePolicySpec(), "Restart"),
    ("no-match", "Failed", Reason.TRAINING_FAILED, [1], POLICY, FailureVerdict("Restart")),
    # By exit code, the first matching rule wins.
    (
        "exit-2",
        "Failed",
        Reason.TRAINING_FAILED,
        [2],
        POLICY,
        FailureVerdict("FailJob", "bad-config"),
    ),
    (
        "any-code",
        "Failed",
        Reason.TRAINING_FAILED,
        [1, 2],
        POLICY,
        FailureVerdict("FailJob", "bad-config"),
    ),
    (
        "exit-139",
        "Failed",
        Reason.TRAINING_FAILED,
        [139],
        POLICY,
        FailureVerdict("Ignore", "flaky-nccl"),
    ),
    # By reason; an unnamed rule is named by its place.
    ("evicted", "Failed", Reason.KUBELET_EVICTED, [], POLICY, FailureVerdict("Ignore", "rules[1]")),
    # Both lists: both must match; else the next rule.
    ("oom-137", "Failed", Reason.OOM_KILLED, [137], POLICY, FailureVerdict("FailJob", "oom")),
    (
        "oom-no-code",
        "Failed",
        Reason.OOM_KILLED,
        [],
        POLICY,
        FailureVerdict("Restart", "other-oom"),
    ),
    # A rule with an exit-code list never matches a failure without exit codes.
    ("never-ready", "Failed", Reason.PODS_NEVER_READY, [], POLICY, FailureVerdict("Restart")),
]


@pytest.mark.parametrize(
    ("outcome", "reason", "codes", "policy", "expected"),
    [c[1:] for c in DECISIONS],
    ids=[c[0] for c in DECISIONS],
)
def test_decide_failure(
    outcome: str,
    reason: str,
    codes: list[int],
    policy: models.FailurePolicySpec | None,
    expected: FailureVerdict | str | None,
) -> None:
    verdict = decide_failure(outcome, reason, codes, policy)
    if isinstance(expected, str):
        expected = FailureVerdict(expected)  # type: ignore[arg-type]
    assert verdict == expected
    if verdict is not None:
        assert verdict.counts == (verdict.action != "Ignore")


def test_a_peer_or_a_preempted_rank_never_shows_its_exit_code_to_the_rules() -> None:
    """The codes a rule sees are those of containers that failed on their own: rank 1 exiting
    EXIT_PEER_FAILED or 75 beside rank 0's crash does not match a rule on those codes."""
    pods = [
        make_pod("p0", index=0, phase="Failed", exit_code=3),
        make_pod("p1", index=1, phase="Failed", exit_code=protocol.EXIT_PEER_FAILED),
    ]
    intr = classify_interruption(make_job(completions=2), pods)
    assert intr.outcome == "Failed"
    ends = [e for e in (container_end(p) for p in pods) if e is not None]
    codes = [e.exit_code for e in ends if e.real_failure and e.exit_code is not None]
    assert codes == [3]
    peer_rule = models.FailurePolicySpec.model_validate(
        {"rules": [{"action": "FailJob", "onExitCodes": [protocol.EXIT_PEER_FAILED]}]}
    )
    assert decide_failure(intr.outcome, intr.reason, codes, peer_rule) == FailureVerdict("Restart")


T0 = parse_rfc3339("2026-01-01T00:00:00Z") or 0.0
DAY = 86400


def _at(seconds: float) -> str:
    return dt.datetime.fromtimestamp(T0 + seconds, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


WINDOWS = [
    # No window: every counted failure (the total, even beyond the kept times).
    ("no-window", 7, [_at(0), _at(DAY)], 14 * DAY, None, 7),
    # Four hardware blips over two weeks, a one-day window: only the newest counts.
    ("blips", 4, [_at(0), _at(4 * DAY), _at(9 * DAY), _at(13 * DAY)], 13 * DAY + 60, DAY, 1),
    ("burst", 4, [_at(0), _at(60), _at(120), _at(180)], 200, 3600, 4),
    ("edge-out", 1, [_at(0)], 3600, 3600, 0),
    ("edge-in", 1, [_at(0)], 3599, 3600, 1),
    ("none-yet", 0, None, 0, 3600, 0),
    ("bad-stamp", 2, ["garbage", _at(0)], 10, 3600, 1),
]


@pytest.mark.parametrize(
    ("total", "times", "now", "window", "expected"),
    [c[1:] for c in WINDOWS],
    ids=[c[0] for c in WINDOWS],
)
def test_counted_failures(
    total: int, times: list[str] | None, now: float, window: int | None, expected: int
) -> None:
    assert counted_failures(total, times, T0 + now, window) == expected


@pytest.mark.parametrize(
    ("before", "max_restarts", "kept"),
    [
        (0, 3, 1),
        (3, 3, 4),  # maxRestarts + 1: enough to see more than maxRestarts in a window
        (10, 3, 4),
        (0, 0, 1),
        (MAX_FAILURE_TIMES + 5, 10**6, MAX_FAILURE_TIMES),
    ],
)
def test_keep_failure_times_is_bounded(before: int, max_restarts: int, kept: int) -> None:
    times = [_at(i) for i in range(before)]
    out = keep_failure_times(times, _at(before), max_restarts)
    assert len(out) == kept and out[-1] == _at(before)


def _failed(**kw: Any) -> PhaseInputs:
    base: dict[str, Any] = {
        "attempt": 2,
        "job_exists": True,
        "recorded_outcome": "Failed",
        "recorded_reason": Reason.TRAINING_FAILED,
        "max_restarts": 3,
        "failures": 1,
    }
    base.update(kw)
    return PhaseInputs(**base)


PHASES = [
    ("restart", _failed(recorded_failure_action="Restart"), "Requeueing", "create_attempt", None),
    (
        "failjob-at-once",
        _failed(recorded_failure_action="FailJob", recorded_failure_rule="bad-config"),
        "Failed",
        "finish",
        Reason.FAILED_BY_POLICY,
    ),
    # Ignore: not counted (the reconciler does not add it to failures), restarted.
    (
        "ignore",
        _failed(recorded_failure_action="Ignore", failures=0),
        "Requeueing",
        "create_attempt",
        None,
    ),
    (
        "exhausted-in-window",
        _failed(recorded_failure_action="Restart", failures=4, restart_window_seconds=DAY),
        "Failed",
        "finish",
        Reason.RESTARTS_EXHAUSTED,
    ),
    # Seven failures in all, one in the window: restarted.
    (
        "old-failures-forgotten",
        _failed(recorded_failure_action="Restart", failures=1, restart_window_seconds=DAY),
        "Requeueing",
        "create_attempt",
        None,
    ),
    # A record from before the failure policy existed (no action) behaves as before.
    ("legacy-record", _failed(failures=4), "Failed", "finish", Reason.RESTARTS_EXHAUSTED),
]


@pytest.mark.parametrize(
    ("inputs", "phase", "action", "reason"), [c[1:] for c in PHASES], ids=[c[0] for c in PHASES]
)
def test_next_phase_with_failure_policy(
    inputs: PhaseInputs, phase: str, action: str, reason: str | None
) -> None:
    decision = next_phase(inputs)
    assert (decision.phase, decision.action) == (phase, action)
    if reason is not None:
        assert decision.reason == reason
    if reason == Reason.FAILED_BY_POLICY:
        assert "bad-config" in decision.message and "FailJob" in decision.message
    if reason == Reason.RESTARTS_EXHAUSTED and inputs.restart_window_seconds:
        assert f"in the last {DAY} s" in decision.message


def test_failure_policy_never_touches_a_preemption_phase() -> None:
    """A preempted attempt requeues at once whatever the rules say (they are never consulted)."""
    inputs = PhaseInputs(
        attempt=2,
        job_exists=True,
        recorded_outcome="Preempted",
        recorded_reason=Reason.RUNTIME_PREEMPTED,
        recorded_failure_action=None,
        failures=99,
        max_restarts=0,
    )
    assert next_phase(inputs).action == "create_attempt"
    assert next_phase(inputs).reason == Reason.REQUEUED
    assert Interruption("Preempted", Reason.RUNTIME_PREEMPTED).over


BAD_SPECS = [
    ("exit-75", {"rules": [{"action": "FailJob", "onExitCodes": [1, 75]}]}, "must not list 75"),
    ("exit-0", {"rules": [{"action": "Ignore", "onExitCodes": [0]}]}, "greater than or equal to 1"),
    ("exit-256", {"rules": [{"action": "Ignore", "onExitCodes": [256]}]}, "less than or equal"),
    ("bad-action", {"rules": [{"action": "Retry"}]}, "FailJob"),
    (
        "preemption-reason",
        {"rules": [{"action": "FailJob", "onReasons": ["NodeLost"]}]},
        "OOMKilled",
    ),
    ("no-action", {"rules": [{"onExitCodes": [1]}]}, "Field required"),
    ("window-0", {"restartWindowSeconds": 0}, "greater than or equal to 1"),
]


@pytest.mark.parametrize(
    ("policy", "fragment"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS]
)
def test_bad_failure_policies_are_refused(policy: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError) as info:
        make_spec(failurePolicy=policy)
    assert fragment in models.format_validation_error(info.value)


def test_the_crd_refuses_exit_75_with_the_same_message() -> None:
    schema = models.FailurePolicyRule.model_json_schema()
    (rule,) = schema["x-kubernetes-validations"]
    assert rule["rule"] == "!(has(self.onExitCodes)) || (!self.onExitCodes.exists(v, v in [75]))"
    assert "must not list 75" in rule["message"] and rule["fieldPath"] == ".onExitCodes"


def test_defaults() -> None:
    spec = make_spec()
    assert spec.failure_policy is None
    assert spec.unreachable_node.escalate_after_seconds == 600
    assert "failurePolicy" not in spec.to_k8s()


# ------------------------------------------------------------------ unreachable nodes

NOT_READY_SINCE = T0  # the node went NotReady at T0; pods have a 30 s grace (make_pod)


def _pod(name: str = "p0", node: str = "n1", **kw: Any) -> dict[str, Any]:
    return make_pod(name, node=node, **kw)


STUCK = [
    # Not deleted: deadline = NotReady since + grace (30 s); bound 600 s.
    ("before-bound", [_pod()], {"n1": False}, 629, 600, None),
    ("past-bound", [_pod()], {"n1": False}, 630, 600, ("n1",)),
    # Deleted (deletionTimestamp T0, make_pod): the deadline is the deletionTimestamp.
    ("deleted-past", [_pod(deleting=True)], {"n1": False}, 600, 600, ("n1",)),
    ("deleted-before", [_pod(deleting=True)], {"n1": False}, 599, 600, None),
    ("ready-node", [_pod()], {"n1": True}, 10**6, 600, None),
    # The Node is gone: the pod GC settles it, nothing to ask.
    ("node-deleted", [_pod()], {}, 10**6, 600, None),
    ("terminated", [_pod(phase="Failed", exit_code=1)], {"n1": False}, 10**6, 600, None),
    ("unbound", [_pod(node="")], {"n1": False}, 10**6, 600, None),
    ("bound-0", [_pod()], {"n1": False}, 30, 0, ("n1",)),
    (
        "two-nodes",
        [_pod("p0", "n2"), _pod("p1", "n1"), _pod("p2", "n3")],
        {"n1": False, "n2": False, "n3": True},
        10**4,
        600,
        ("n1", "n2"),
    ),
]


@pytest.mark.parametrize(
    ("pods", "ready", "now", "after", "nodes"), [c[1:] for c in STUCK], ids=[c[0] for c in STUCK]
)
def test_stuck_on_unreachable_nodes(
    pods: list[dict[str, Any]],
    ready: dict[str, bool],
    now: float,
    after: int,
    nodes: tuple[str, ...] | None,
) -> None:
    since = {n: NOT_READY_SINCE for n, ok in ready.items() if not ok}
    stuck = stuck_on_unreachable_nodes(pods, ready, since, T0 + now, after)
    if nodes is None:
        assert stuck is None
        return
    assert stuck is not None and stuck.nodes == nodes
    text = stuck.message(T0 + now)
    assert OUT_OF_SERVICE_TAINT in text and f"kubectl delete node {nodes[0]}" in text
    assert "force-deletes its pods and detaches their volumes" in text


def test_no_escalation_without_a_known_deadline() -> None:
    """A NotReady node whose Ready condition has no transition time and an undeleted pod: no
    deadline to measure from, so no escalation (never a guess)."""
    assert stuck_on_unreachable_nodes([_pod()], {"n1": False}, {}, T0 + 10**6, 0) is None


def test_the_reconciler_raises_node_unreachable_once_and_clears_it() -> None:
    """The pass's wiring: condition NodeUnreachable True with one Warning Event while a pod is
    stuck past the bound, no second Event on the next pass, False once the pod is gone."""
    now = [T0 + 30 + 600]
    rec = Reconciler(kubernetes.client.ApiClient(), OperatorConfig(), clock=lambda: now[0])
    spec = make_spec()
    status = models.TrainingJobStatus()

    def observed(pods: list[dict[str, Any]]) -> _Observed:
        return _Observed(
            obj={"metadata": {"name": "tj", "namespace": "ns", "uid": "u"}},
            status=status,
            spec=spec,
            invalid=None,
            jobs={},
            pods_by_attempt={1: pods},
            attempt=1,
            job=None,
            pods=pods,
            workload=None,
            workload_version=None,
            node_ready={"n1": False},
            node_not_ready_since={"n1": NOT_READY_SINCE},
        )

    def run(pods: list[dict[str, Any]]) -> PassResult:
        result = PassResult()
        status.conditions, event = unreachable_condition(
            observed(pods), spec, status.conditions, False, "t", 1, rec.clock()
        )
        result.events.extend([event] if event is not None else [])
        return result

    first = run([_pod()])
    found = cond.find_condition(status.conditions, cond.NODE_UNREACHABLE)
    assert found is not None and found.status == "True"
    assert found.reason == Reason.OUT_OF_SERVICE_NEEDED
    assert [e[:2] for e in first.events] == [("Warning", Reason.OUT_OF_SERVICE_NEEDED)]
    assert run([_pod()]).events == []  # still stuck: no second Event
    assert run([]).events == []
    found = cond.find_condition(status.conditions, cond.NODE_UNREACHABLE)
    assert found is not None and found.status == "False" and found.reason == Reason.NODES_REACHABLE
    # A job whose pods never were stuck gets no condition at all.
    status.conditions = None
    now[0] = T0 + 10
    run([_pod()])
    assert cond.find_condition(status.conditions, cond.NODE_UNREACHABLE) is None


def test_the_schema_lists_exactly_the_failure_reasons() -> None:
    """models cannot import conditions (it imports models): the enum of onReasons is spelled out
    there, and must stay the reasons classify gives real failures, none of them a preemption."""
    assert set(models.FAILURE_REASONS) == {
        Reason.TRAINING_FAILED,
        Reason.OOM_KILLED,
        Reason.KUBELET_EVICTED,
        Reason.PODS_NEVER_READY,
        Reason.JOB_FAILED,
    }
    assert not set(models.FAILURE_REASONS) & cond.PREEMPTION_REASONS
