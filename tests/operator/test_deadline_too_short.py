"""A node notice shorter than the save, on the real control plane: the runtime does not start a
save it cannot finish and exits at once; the operator records the attempt as DeadlineTooShort,
counts the lost steps, does not double the grace, recommends a checkpoint interval (status, event,
`kubectl get tj` column) and, with spec.checkpoint.interval auto, passes it to the next attempt."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.cluster.controlplane import ControlPlane
from tests.cluster.node_agent import NodeAgent
from tests.operator.harness import OperatorProcess, TJClient, toy_training_job, wait_for
from trainer_runtime import protocol
from trainer_runtime.checkpoint.layout import CheckpointStore

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_deadline_too_short_is_recorded_and_an_interval_recommended(
    control_plane: ControlPlane,
    node_agent: NodeAgent,
    tj: TJClient,
    operator: OperatorProcess,
    checkpoint_root: Path,
) -> None:
    name = "notice"
    # Every checkpoint file takes 0.3 s to write (a save takes seconds); the node gives 1 s of
    # notice, the pod's grace is 30 s: the JIT save cannot fit the notice.
    grace = {
        "initialSeconds": 30,
        "min": 5,
        "max": 120,
        "killWaitSeconds": 0.2,
        "nodeNoticeSeconds": 1,
    }
    body = toy_training_job(
        name,
        checkpoint_root,
        max_steps=8,
        step_sleep=1.0,
        save_steps=3,
        # Blocking periodic saves: checkpoint 3 is complete when step 4 begins, so the eviction
        # lands at a known step (a background save would commit a step or more later).
        extra_args=("--save-sleep", "0.3", "--save-async", "false"),
        grace=grace,
    )
    body["spec"]["checkpoint"]["interval"] = "auto"
    tj.create(body)

    # Straight from the checkpoint volume (the status lags by a poll): evict during step 4.
    store = CheckpointStore(str(checkpoint_root / name))
    wait_for(
        "checkpoint 3 complete",
        lambda: store.inspect(str(checkpoint_root / name / "checkpoint-3")).complete or None,
        interval=0.1,
        on_timeout=lambda: tj.describe(name),
    )
    # A SIGTERM still at step 3 (checkpoint 3 just committed) needs no save and reads as a plain
    # preemption: let step 4 (1 s long) begin first, a slow machine's post-save work included.
    time.sleep(0.3)
    pod = tj.running_pod(name, 1)
    assert pod is not None
    tj.evict(pod.metadata.name)
    status = wait_for(
        "finished",
        lambda: tj.phase_is(name, "Succeeded", "Failed"),
        on_timeout=lambda: tj.describe(name) + operator.tail(),
    )
    assert status["phase"] == "Succeeded", tj.describe(name)
    first, second = status["attempts"][:2]
    assert (first["outcome"], first["reason"]) == ("Preempted", "DeadlineTooShort"), first
    assert "deadline too short" in first["message"]
    assert first["exitCodes"] == [protocol.EXIT_PREEMPTED] and first["killed"] is False, first
    # Nothing was written after the SIGTERM: the newest complete checkpoint is still step 3.
    assert first["checkpoint"].endswith("checkpoint-3"), first
    assert first["endStep"] >= 4 and first["lostSteps"] == first["endStep"] - 3, first
    assert first["sigtermToExitSeconds"] < 30, first
    assert second["resumeFrom"] == first["checkpoint"] and second["startStep"] == 3
    # Not SIGKILLed: the grace is not doubled.
    assert second["graceSeconds"] < 2 * first["graceSeconds"], (first, second)
    assert status["lostSteps"] == first["lostSteps"] and status["preemptions"] == 1

    interval = status["checkpointInterval"]
    assert interval["preemptions"] == 1 and interval["applied"] is True, interval
    assert interval["recommendedSeconds"] >= 30, interval
    reasons = [r for r, _ in tj.events(name)]
    assert "DeadlineTooShort" in reasons and "CheckpointIntervalRecommended" in reasons, reasons
    out = control_plane.kubectl("get", "tj", name, "-n", tj.ns).stdout.splitlines()
    header = out[0].split()
    assert out[1].split()[header.index("SAVE-EVERY")] == str(interval["recommendedSeconds"]), out
    # spec.checkpoint.interval auto: attempt 2 was given the recommendation of attempt 1's end.
    (job,) = [j for j in tj.jobs(name) if j.metadata.name == f"{name}-a2"]
    env = {e.name: e.value for e in job.spec.template.spec.containers[0].env}
    assert env[protocol.ENV_SAVE_INTERVAL_SECONDS] == str(interval["recommendedSeconds"]), env
    assert env[protocol.ENV_NODE_NOTICE_SECONDS] == "1", env
