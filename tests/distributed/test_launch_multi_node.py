"""Two pods, each running ``trainer-runtime launch`` (a torchrun agent with static rendezvous on
pod 0's address, as the operator's environment describes), one worker each. SIGTERM reaches only
pod 1's launcher: both pods' workers stop at the same step, the checkpoint is complete, and both
launchers exit 75 (pod 0 without having been signalled at all)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import MAX_STEPS, RUN_TIMEOUT, toy_args
from tests.distributed.ranks import free_port
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_GRACE_SECONDS,
    ENV_KILL_WAIT_SECONDS,
    ENV_OUTPUT_DIR,
    ENV_TERMINATION_LOG,
    EXIT_PREEMPTED,
)
from trainer_runtime.testing import read_events, read_termination_message

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

PODS = 2


def _pod(tmp_path: Path, port: int, node: int) -> tuple[subprocess.Popen[bytes], Path]:
    work = tmp_path / f"pod{node}"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    env.update(
        {
            ENV_OUTPUT_DIR: str(tmp_path / "out"),
            ENV_ATTEMPT: "1",
            ENV_GRACE_SECONDS: "120",
            ENV_KILL_WAIT_SECONDS: "0.2",
            ENV_TERMINATION_LOG: str(work / "term.json"),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(PODS),
            "NODE_RANK": str(node),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    toy = ["-m", "trainer_runtime.toy", *toy_args(step_sleep=0.3)]
    toy += ["--events-file", str(work / "events.jsonl")]
    cmd = [sys.executable, "-m", "trainer_runtime.cli", "launch", "--nproc-per-node", "1", "--"]
    with open(work / "launcher.log", "wb") as log:
        proc = subprocess.Popen([*cmd, *toy], env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, work


def test_sigterm_to_one_pods_launcher(tmp_path: Path) -> None:
    port = free_port()
    pods = [_pod(tmp_path, port, node) for node in range(PODS)]
    try:
        events = pods[1][1] / "events.jsonl"
        deadline = time.monotonic() + RUN_TIMEOUT
        while not any(e["event"] == "step_begin" and e["step"] == 5 for e in read_events(events)):
            assert all(p.poll() is None for p, _ in pods), "a pod exited before step 5"
            assert time.monotonic() < deadline, "no step 5 in time"
            time.sleep(0.05)
        pods[1][0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=RUN_TIMEOUT) for p, _ in pods]
    finally:
        for p, _ in pods:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((w / "launcher.log").read_text(errors="replace")[-2500:] for _, w in pods)
    assert codes == [EXIT_PREEMPTED] * PODS, f"launcher exit codes {codes}\n{logs}"
    steps = set()
    for _, work in pods:
        msg = read_termination_message((work / "term.json").read_text())
        assert msg is not None and msg.reason == "preempted" and msg.complete, msg
        steps.add(msg.step)
        ended = [e["step"] for e in read_events(work / "events.jsonl") if e["event"] == "step_end"]
        assert ended[-1] == msg.step, (ended[-1], msg)
    (step,) = steps
    assert 5 <= step < MAX_STEPS
    info = CheckpointStore(str(tmp_path / "out")).inspect(f"checkpoint-{step}")
    assert info.complete and info.manifest is not None and info.manifest["world_size"] == PODS
