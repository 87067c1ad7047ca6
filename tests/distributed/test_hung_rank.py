"""A rank hung in a collective during the JIT save (alive, its heartbeat thread beating) ends the
pod before the grace does, with a termination message naming it (issue 37, item 3).

One pod of two workers under ``trainer-runtime launch`` (real torchrun, gloo, a real SIGTERM to
the launcher). Rank 1 waits forever in a receive nobody sends once the JIT save began; rank 0
waits for it in the commit's barrier. The training loop's own progress stamps tell the two apart:
rank 1's stopped, rank 0's went on to the barrier. Before the fix the pod ran into torchrun's
shutdown timeout (the whole grace) and the kubelet's SIGKILL: exit 137, no message.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.test_launch_pod_end import _env, _finish, _message
from trainer_runtime.distributed.launch import launcher_end_seconds
from trainer_runtime.protocol import ENV_GRACE_SECONDS
from trainer_runtime.testing import read_events

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]

GRACE = 20
WORKER = Path(__file__).with_name("hang_worker.py")


def test_a_rank_hung_in_a_collective_is_named_before_the_grace_ends(tmp_path: Path) -> None:
    import subprocess

    events = tmp_path / "events.jsonl"
    env = {**_env(tmp_path), ENV_GRACE_SECONDS: str(GRACE), "HANG_RANK": "1"}
    command = [
        "python", str(WORKER), "--max-steps", "200", "--save-steps", "1000",
        "--step-sleep", "0.2", "--seed", "5", "--events-file", str(events),
    ]  # fmt: skip
    log = tmp_path / "launcher.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_runtime.cli", "launch", "--", *command],
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            if any(e["event"] == "step_begin" and e["step"] >= 3 for e in read_events(events)):
                break
            time.sleep(0.05)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = _finish(proc, log, timeout=GRACE + 60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")[-5000:]
    assert any(e["event"] == "hang" for e in read_events(events)), output
    msg = _message(tmp_path)
    # The pod ended before the grace (and before the launcher would have given up on torchrun)
    assert took < launcher_end_seconds(GRACE) < GRACE, f"took {took:.1f} s\n{output}"
    assert "torchrun had not ended" not in output, output
    assert code not in (0, 75, 137), f"{code}: {msg}\n{output}"
    text = msg.message or ""
    assert msg.reason == "failed" and msg.rank == 1, f"{msg}\n{output}"
    assert "rank 1 hung" in text and "writing the JIT checkpoint-" in text, msg
    assert msg.exit_codes is not None and 137 not in msg.exit_codes, msg
