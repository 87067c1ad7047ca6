"""One pod of two workers under ``trainer-runtime launch`` (real torchrun, real signals, gloo),
ending as one unit: one termination message, one exit code, one /metrics.

- a local worker raises: the pod exits with its code (1) promptly, the message names its local
  and global rank and its error; the other worker, SIGTERMed by torchrun, is not taken for a
  preemption (no 75 anywhere);
- a local worker is SIGKILLed with nobody asking (the OOM killer of one process): exit 137 with
  a ``failed`` message naming it, which the operator does not read as a grace too short;
- a script that builds a process group of another shape gets a clear error within seconds
  (bare torchrun: it waits out the 30-minute timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import RUN_TIMEOUT
from tests.distributed.ranks import free_port
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_GRACE_SECONDS,
    ENV_KILL_WAIT_SECONDS,
    ENV_METRICS_HOST,
    ENV_METRICS_PORT,
    ENV_OUTPUT_DIR,
    ENV_TERMINATION_LOG,
    EXIT_PREEMPTED,
    TerminationMessage,
)
from trainer_runtime.testing import read_events, read_termination_message

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTIBLE_", "PET_"))}
    env.update(
        {
            ENV_OUTPUT_DIR: str(tmp_path / "out"),
            ENV_ATTEMPT: "1",
            ENV_GRACE_SECONDS: "60",
            ENV_KILL_WAIT_SECONDS: "0.2",
            ENV_TERMINATION_LOG: str(tmp_path / "term.json"),
            ENV_METRICS_PORT: str(free_port()),
            ENV_METRICS_HOST: "127.0.0.1",
            # What the operator renders for numNodes: 1, numProcPerNode: 2.
            "PET_NNODES": "1",
            "PET_NPROC_PER_NODE": "2",
            "PET_NODE_RANK": "0",
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _launch(tmp_path: Path, command: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "launcher.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_runtime.cli", "launch", "--", *command],
            env=_env(tmp_path),
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    return proc, log


def _finish(proc: subprocess.Popen[bytes], log: Path, timeout: float = RUN_TIMEOUT) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        pytest.fail(
            f"the pod did not end in {timeout} s\n{log.read_text(errors='replace')[-4000:]}"
        )


def _message(tmp_path: Path) -> TerminationMessage:
    msg = read_termination_message((tmp_path / "term.json").read_text())
    assert msg is not None, (tmp_path / "term.json").read_text()
    return msg


def _toy(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "python", "-m", "trainer_runtime.toy", "--max-steps", "40", "--save-steps", "100",
        "--step-sleep", "0.2", "--seed", "5", "--events-file", str(tmp_path / "events.jsonl"),
        *extra,
    ]  # fmt: skip


def test_a_local_worker_failure_fails_the_pod_with_its_own_code(tmp_path: Path) -> None:
    proc, log = _launch(tmp_path, _toy(tmp_path, "--fail-at-step", "4", "--fail-rank", "1"))
    started = time.monotonic()
    code = _finish(proc, log)
    took = time.monotonic() - started
    output = log.read_text(errors="replace")
    msg = _message(tmp_path)
    assert code == 1, f"{code}: {msg}\n{output[-4000:]}"
    assert (msg.reason, msg.local_rank, msg.rank) == ("failed", 1, 1), msg
    assert "injected failure at step 4" in (msg.message or ""), msg
    # The other worker got torchrun's SIGTERM: it noticed its peer gone, it did not save a JIT
    # checkpoint and no exit says "preempted".
    assert msg.exit_codes is not None and msg.exit_codes[1] == 1, msg
    assert EXIT_PREEMPTED not in msg.exit_codes, msg
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("checkpoint-*"))
    # One /metrics per pod: only local rank 0 served it, nobody failed to bind.
    assert "cannot serve /metrics" not in output, output[-4000:]
    assert took < 90, f"took {took:.0f} s"


def _worker_pid(events: Path, local_rank: int, step: int, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        for event in read_events(events):
            if event["event"] == "step_begin" and event["step"] >= step:
                with open(f"/proc/{event['pid']}/environ", "rb") as fh:
                    environ = fh.read().split(b"\0")
                if f"LOCAL_RANK={local_rank}".encode() in environ:
                    return int(event["pid"])
        time.sleep(0.05)
    pytest.fail(f"no step {step} of local rank {local_rank}")


def test_a_worker_killed_on_its_own_is_a_failure_not_a_grace_kill(tmp_path: Path) -> None:
    proc, log = _launch(tmp_path, _toy(tmp_path))
    try:
        victim = _worker_pid(tmp_path / "events.jsonl", 1, 3, proc)
        os.kill(victim, signal.SIGKILL)
        code = _finish(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    msg = _message(tmp_path)
    assert code == 137, f"{code}: {msg}\n{log.read_text(errors='replace')[-3000:]}"
    # A message the pod could not have written had the kubelet killed it at the deadline.
    assert (msg.reason, msg.local_rank, msg.rank) == ("failed", 1, 1), msg
    assert "exited 137" in (msg.message or ""), msg


WRONG_WORLD = """
import os, torch.distributed as dist
dist.init_process_group("gloo", world_size=8, rank=int(os.environ["RANK"]))
"""


def test_a_process_group_of_another_shape_is_refused_not_a_hang(tmp_path: Path) -> None:
    script = tmp_path / "own_group.py"
    script.write_text(WRONG_WORLD)
    proc, log = _launch(tmp_path, ["python", str(script)])
    started = time.monotonic()
    code = _finish(proc, log, timeout=120)
    took = time.monotonic() - started
    msg = _message(tmp_path)
    assert code == 1, f"{code}: {msg}\n{log.read_text(errors='replace')[-3000:]}"
    assert msg.reason == "failed" and msg.local_rank is not None, msg
    assert "init_process_group(world_size=8)" in (msg.message or ""), msg
    assert "WORLD_SIZE=2" in (msg.message or ""), msg
    assert took < 60, f"took {took:.0f} s"
