"""Operator restarts, user suspension and real failures on the real control plane."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _describe(tj: TJClient, name: str, op: OperatorProcess) -> str:
    return tj.describe(name) + "\n" + op.tail()


def test_operator_restarts_converge_without_duplicate_jobs(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    tj.create(toy_training_job("rs", checkpoint_root, max_steps=30, step_sleep=0.3))
    wait_for(
        "running at step >= 3",
        lambda: (tj.status("rs").get("progress") or {}).get("step", 0) >= 3,
        on_timeout=lambda: _describe(tj, "rs", operator),
    )
    # 1. The operator dies; the pod is evicted while nobody watches. The pod finishes its JIT
    #    checkpoint and stays (finalizer) until the operator has recorded it.
    operator.kill()
    pod = tj.running_pod("rs", 1)
    assert pod is not None
    tj.evict(pod.metadata.name)
    wait_for(
        "evicted pod terminal",
        lambda: all(p.status.phase == "Failed" for p in tj.pods("rs", 1)) and tj.pods("rs", 1),
        on_timeout=lambda: _describe(tj, "rs", operator),
    )
    assert tj.status("rs").get("attempt") == 1
    # 2. It comes back, records the attempt and creates attempt 2; it dies again right then.
    operator.start()
    wait_for(
        "attempt 2 Job",
        lambda: any(j.metadata.name == "rs-a2" for j in tj.jobs("rs")),
        on_timeout=lambda: _describe(tj, "rs", operator),
    )
    operator.kill()
    operator.start()
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("rs", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, "rs", operator),
    )
    assert status["phase"] == "Succeeded", _describe(tj, "rs", operator)
    assert [a["attempt"] for a in status["attempts"]] == [1, 2]
    first, second = status["attempts"]
    assert first["reason"] == "PodEvicted" and first["lostSteps"] == 0
    assert second["startStep"] == first["endStep"]
    assert status["preemptions"] == 1
    assert [j.metadata.name for j in tj.jobs("rs")] == ["rs-a2"]
    created = [m for r, m in tj.events("rs") if r in ("AttemptCreated", "Requeued")]
    assert len(created) == 2, created
    wait_for(
        "pod finalizers released",
        lambda: not any(p.metadata.finalizers for p in tj.pods("rs")),
        timeout=30,
        on_timeout=lambda: _describe(tj, "rs", operator),
    )


def test_suspend_checkpoints_and_resume_continues(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    # Periodic saves every 2 steps: a complete checkpoint precedes the JIT one.
    tj.create(toy_training_job("sus", checkpoint_root, max_steps=24, step_sleep=0.3, save_steps=2))
    wait_for(
        "running at step >= 3",
        lambda: (tj.status("sus").get("progress") or {}).get("step", 0) >= 3,
        on_timeout=lambda: _describe(tj, "sus", operator),
    )
    tj.patch_spec("sus", {"suspend": True})
    status = wait_for(
        "Suspended with the attempt recorded",
        lambda: (
            (s := tj.phase_is("sus", "Suspended"))
            and (s.get("attempts") or [{}])[-1].get("endTime")
            and s
        ),
        on_timeout=lambda: _describe(tj, "sus", operator),
    )
    (first,) = status["attempts"]
    assert (first["outcome"], first["reason"], first["exitCodes"]) == (
        "Suspended",
        "Suspended",
        [75],
    )
    assert first["lostSteps"] == 0 and first["checkpoint"].endswith(f"-{first['endStep']}")
    assert not tj.pods("sus") or all(p.status.phase == "Failed" for p in tj.pods("sus"))
    # The JIT checkpoint rots while suspended (same size, one byte flipped: it still lists as
    # complete, so the operator still names it); the runtime finds it corrupt on load, falls
    # back to the periodic checkpoint before it, and the operator records what was loaded.
    model = Path(first["checkpoint"]) / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-3] ^= 0xFF
    model.write_bytes(bytes(data))
    tj.patch_spec("sus", {"suspend": False})
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("sus", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, "sus", operator),
    )
    assert status["phase"] == "Succeeded"
    second = status["attempts"][1]
    assert second["resumeFrom"] == first["checkpoint"]
    loaded = second["resumedFrom"]
    assert loaded != first["checkpoint"] and second["startStep"] < first["endStep"], second
    assert loaded.endswith(f"checkpoint-{second['startStep']}"), second
    assert status.get("preemptions", 0) == 0 and status.get("failures", 0) == 0
    events = tj.events("sus")
    assert "Resumed" in [r for r, _ in events]
    (fell_back,) = [m for r, m in events if r == "ResumeFellBack"]
    assert first["checkpoint"] in fell_back or f"step {first['endStep']}" in fell_back


def test_real_failures_use_max_restarts_with_backoff(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    tj.create(
        toy_training_job(
            "fail",
            checkpoint_root,
            max_steps=10,
            step_sleep=0.1,
            extra_args=("--fail-at-step", "2"),
            maxRestarts=1,
            restartBackoffSeconds=2,
        )
    )
    status = wait_for(
        "Failed",
        lambda: tj.phase_is("fail", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, "fail", operator),
    )
    assert status["phase"] == "Failed"
    assert status["failures"] == 2 and status.get("preemptions", 0) == 0
    assert [a["outcome"] for a in status["attempts"]] == ["Failed", "Failed"]
    assert all(
        a["reason"] == "TrainingFailed" and a["exitCodes"] == [1] for a in status["attempts"]
    )
    failed = {c["type"]: c for c in status["conditions"]}["Failed"]
    assert failed["reason"] == "RestartsExhausted"

    # Events are posted after the status write (kopf posts them on their own): wait for them
    # rather than read once (CI once saw the Failed phase before the RestartsExhausted event).
    def both_reasons() -> list[str] | None:
        reasons = [reason for reason, _ in tj.events("fail")]
        return reasons if {"TrainingFailed", "RestartsExhausted"} <= set(reasons) else None

    reasons = wait_for(
        "TrainingFailed and RestartsExhausted events",
        both_reasons,
        timeout=30,
        on_timeout=lambda: str(tj.events("fail")),
    )
    assert reasons.count("RestartBackoff") == 1


def test_adopts_the_job_of_a_pass_that_crashed_before_writing_status(
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    from preemptible_operator import models, render

    operator.kill()
    body = tj.create(toy_training_job("adopt", checkpoint_root, max_steps=6, step_sleep=0.2))
    # What the crashed pass had created: attempt 1's Job, status never written.
    params = render.AttemptParams(
        attempt=1, grace_seconds=17, resume_from="", suspended=False, start_step=0
    )
    meta = {**body["metadata"], "namespace": tj.ns}
    tj.batch.create_namespaced_job(
        tj.ns, render.render_job(meta, models.parse_spec(body["spec"]), params)
    )
    assert tj.status("adopt") == {}
    operator.start()
    status = wait_for(
        "Succeeded",
        lambda: tj.phase_is("adopt", "Succeeded", "Failed"),
        on_timeout=lambda: _describe(tj, "adopt", operator),
    )
    assert status["phase"] == "Succeeded"
    (attempt,) = status["attempts"]
    assert (attempt["jobName"], attempt["graceSeconds"], attempt["startStep"]) == (
        "adopt-a1",
        17,
        0,
    )
    assert [j.metadata.name for j in tj.jobs("adopt")] == ["adopt-a1"]
    assert "AttemptCreated" not in [r for r, _ in tj.events("adopt")]
