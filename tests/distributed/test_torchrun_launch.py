"""A torchrun-launched run: SIGTERM reaches only the agent (as in a pod, where only PID 1 is
signalled), and the workers still save inside the grace period.

torchrun kills its workers ``--shutdown-timeout`` seconds after SIGTERM (default 30, or
$TORCH_ELASTIC_SHUTDOWN_TIMEOUT). The environment here says 1 s, shorter than the JIT save:
under bare torchrun the workers know that deadline (theirs is torchrun's, not the grace) and
write nothing rather than a save torchrun would kill half-way (the control case: no JIT
checkpoint, ``deadline_too_short``); ``trainer-runtime launch`` sets the timeout from
PREEMPTIBLE_GRACE_SECONDS and the save completes, and its exit code is 75.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import MAX_STEPS, RUN_TIMEOUT, toy_args
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

GRACE = 120


def _start(tmp_path: Path, launcher: str) -> tuple[subprocess.Popen[bytes], Path, Path, Path]:
    out, events, term = tmp_path / "out", tmp_path / "events.jsonl", tmp_path / "term.json"
    log = tmp_path / "launcher.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    env.update(
        {
            ENV_OUTPUT_DIR: str(out),
            ENV_ATTEMPT: "1",
            ENV_GRACE_SECONDS: str(GRACE),
            ENV_KILL_WAIT_SECONDS: "0.2",
            ENV_TERMINATION_LOG: str(term),
            # A hostile default: shorter than the JIT save below.
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    toy = ["-m", "trainer_runtime.toy", *toy_args(step_sleep=0.3, save_sleep=0.4)]
    toy += ["--events-file", str(events)]
    if launcher == "launch":
        cmd = [sys.executable, "-m", "trainer_runtime.cli", "launch", "--nproc-per-node", "2"]
        cmd += ["--", *toy]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node=2", "--max-restarts=0", *toy]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
    return proc, out, events, log


def _wait_event(proc: subprocess.Popen[bytes], events: Path, log: Path, step: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline:
        if any(e["event"] == "step_begin" and e["step"] == step for e in read_events(events)):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no step {step} before exit/timeout\n{log.read_text(errors='replace')[-3000:]}")


@pytest.mark.parametrize("launcher", ["launch", "bare-torchrun"])
def test_sigterm_to_torchrun_agent(tmp_path: Path, launcher: str) -> None:
    proc, out, events, log = _start(tmp_path, launcher)
    try:
        _wait_event(proc, events, log, step=6)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # the agent only, never the workers
        code = proc.wait(timeout=RUN_TIMEOUT)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")[-4000:]
    store = CheckpointStore(str(out))
    jit = [c for c in store.list() if c.step > 4]
    if launcher == "bare-torchrun":
        # Control: the 1 s shutdown timeout leaves no time for the JIT save; the workers read it
        # as their deadline and do not start one torchrun would kill half-way.
        assert code != 0, output
        assert not any(c.complete for c in jit), f"bare torchrun gave the save time? {jit}"
        msg = read_termination_message((tmp_path / "term.json").read_text())
        assert msg is not None and msg.reason == "deadline_too_short", f"{msg}\n{output}"
        return
    assert jit, f"no checkpoint after step 4 was even started\n{output}"
    assert code == EXIT_PREEMPTED, f"launch exited {code}\n{output}"
    assert took < GRACE, f"took {took:.1f} s, grace {GRACE} s"
    msg = read_termination_message((tmp_path / "term.json").read_text())
    assert msg is not None and msg.reason == "preempted" and msg.complete, msg
    assert 6 <= msg.step < MAX_STEPS, msg
    info = store.inspect(f"checkpoint-{msg.step}")
    assert info.complete, info.reason
    assert info.manifest is not None and info.manifest["world_size"] == 2, info.manifest
    assert info.save_seconds is not None and info.save_seconds > 1.0, (
        f"the JIT save took {info.save_seconds} s: not longer than the hostile 1 s timeout, "
        "so this test proves nothing; raise --save-sleep"
    )
    # One message for the pod: both workers committed their part; the SIGTERM-to-exit time is
    # the launcher's, to the end of the last worker (within what this test saw from outside).
    assert msg.exit_codes == [EXIT_PREEMPTED, EXIT_PREEMPTED], msg
    assert msg.sigterm_to_exit_seconds is not None, msg
    assert info.save_seconds is not None and msg.sigterm_to_exit_seconds > info.save_seconds
    assert msg.sigterm_to_exit_seconds <= took + 0.5, (msg, took)
