"""spec.failurePolicy on the real control plane: a FailJob rule fails the job at its first
matching failure, an Ignore rule restarts without counting against maxRestarts (issue 30)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _describe(tj: TJClient, name: str, op: OperatorProcess) -> str:
    return tj.describe(name) + "\n" + op.tail()


def test_a_failjob_rule_fails_at_once_and_an_ignore_rule_does_not_count(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    # The toy raises at step 2: its container exits 1 (TrainingFailed).
    common = {
        "max_steps": 10,
        "step_sleep": 0.1,
        "extra_args": ("--fail-at-step", "2"),
        "restartBackoffSeconds": 1,
    }
    tj.create(
        toy_training_job(
            "failjob",
            checkpoint_root,
            maxRestarts=3,
            failurePolicy={
                "rules": [
                    {"name": "not-this", "action": "Ignore", "onReasons": ["OOMKilled"]},
                    {"name": "bad-config", "action": "FailJob", "onExitCodes": [1, 2]},
                ]
            },
            **common,
        )
    )
    tj.create(
        toy_training_job(
            "ignored",
            checkpoint_root,
            maxRestarts=0,
            failurePolicy={"rules": [{"action": "Ignore", "onReasons": ["TrainingFailed"]}]},
            **common,
        )
    )

    # maxRestarts 1 within a 1 s window: attempts fail several seconds apart, so no two failures
    # ever fall in one window and the job restarts on (without the window the second fails it).
    tj.create(
        toy_training_job(
            "windowed",
            checkpoint_root,
            maxRestarts=1,
            failurePolicy={"restartWindowSeconds": 1},
            **common,
        )
    )

    status = wait_for(
        "failjob Failed",
        lambda: tj.phase_is("failjob", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, "failjob", operator),
    )
    # Failed at its first failure although maxRestarts allows three more.
    assert status["phase"] == "Failed"
    (attempt,) = status["attempts"]
    assert attempt["outcome"] == "Failed" and attempt["exitCodes"] == [1]
    assert attempt["failureAction"] == "FailJob" and attempt["failureRule"] == "bad-config"
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert failed["reason"] == "FailedByPolicy" and "bad-config" in failed["message"]
    assert status["failures"] == 1

    # maxRestarts 0, yet every failure is restarted: the Ignore rule's failures never count.
    def ignored_twice() -> dict | None:
        st = tj.status("ignored")
        ended = [a for a in st.get("attempts") or [] if a.get("outcome")]
        return st if len(ended) >= 2 else None

    status = wait_for(
        "two ignored failures",
        ignored_twice,
        on_timeout=lambda: _describe(tj, "ignored", operator),
    )
    assert status["phase"] != "Failed"
    ended = [a for a in status["attempts"] if a.get("outcome")]
    assert all(a["outcome"] == "Failed" and a["failureAction"] == "Ignore" for a in ended)
    assert all(a["failureRule"] == "rules[0]" for a in ended)
    assert not status.get("failures")
    reasons = wait_for(
        "FailureIgnored events",
        lambda: [r for r, _ in tj.events("ignored") if r == "FailureIgnored"] or None,
        timeout=30,
        on_timeout=lambda: str(tj.events("ignored")),
    )
    assert reasons

    def failed_three_times() -> dict | None:
        st = tj.status("windowed")
        return st if (st.get("failures") or 0) >= 3 or st.get("phase") == "Failed" else None

    status = wait_for(
        "three windowed failures",
        failed_three_times,
        on_timeout=lambda: _describe(tj, "windowed", operator),
    )
    assert status["phase"] != "Failed", _describe(tj, "windowed", operator)
    ended = [a for a in status["attempts"] if a.get("outcome")]
    assert all(a["failureAction"] == "Restart" and "failureRule" not in a for a in ended)
    # Bounded: the newest maxRestarts + 1 failure times, whatever the total.
    assert len(status["failureTimes"]) == 2
