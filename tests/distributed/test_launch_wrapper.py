"""The launcher process itself, with a stand-in for its torchrun agent (a tiny Python child): it
forwards the first SIGTERM exactly once, ignores later ones, and ends the pod from what the
workers wrote into the launch's own directory, with the SIGTERM-to-exit time measured to the
child's end. Torch-free and fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_runtime.protocol import (
    EXIT_PREEMPTED,
    TerminationMessage,
    read_termination_message,
)

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(120)]

# Stands in for the agent: counts SIGTERMs for 1.5 s after the first, then "saves" (its one worker
# writes a complete JIT message into $PREEMPTIBLE_TERMINATION_DIR, the agent its record) and exits 1
# the way torchrun does when its workers exit 75.
CHILD = r"""
import json, os, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(time.monotonic()))
open(sys.argv[1] + ".ready", "w").close()
while not got:
    time.sleep(0.01)
time.sleep(1.5)
directory = os.environ["PREEMPTIBLE_TERMINATION_DIR"]
if sys.argv[2] == "preempted":
    with open(os.path.join(directory, "local-rank-0.json"), "w") as fh:
        fh.write(json.dumps({"reason": "preempted", "step": 7, "complete": True,
                             "checkpoint": "/c/checkpoint-7"}))
    with open(os.path.join(directory, "agent.json"), "w") as fh:
        json.dump({"workers": [{"local_rank": 0, "rank": 0, "exit_code": 75}], "nproc": 1}, fh)
with open(sys.argv[1], "w") as fh:
    json.dump({"sigterms": len(got)}, fh)
sys.exit(1)
"""

WRAPPER = r"""
import sys
from trainer_runtime.distributed.launch import LaunchPlan, run_launch
plan = LaunchPlan(command=sys.argv[1:-1], env={}, shutdown_timeout=None, grace_seconds=None,
                  termination_log=sys.argv[-1])
sys.exit(run_launch(plan))
"""


@pytest.mark.parametrize(("verdict", "expected"), [("preempted", EXIT_PREEMPTED), ("none", 1)])
def test_first_sigterm_forwarded_once_and_exit_mapped(
    tmp_path: Path, verdict: str, expected: int
) -> None:
    report, term = tmp_path / "report.json", tmp_path / "term.json"
    # A stale message of an earlier run must not count: the pod's message is written anew.
    term.write_text(TerminationMessage(reason="preempted", step=1).model_dump_json())
    child = [sys.executable, "-c", CHILD, str(report), verdict, str(term)]
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, *child, str(term)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{report}.ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "child never started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)  # a second SIGTERM must not reach the child
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads(report.read_text()) == {"sigterms": 1}
    assert code == expected
    msg = read_termination_message(term.read_text())
    assert msg is not None and msg.reason == ("preempted" if expected == 75 else "failed"), msg
    # Measured by the launcher from its own SIGTERM to the end of its child (1.5 s of "saving").
    assert msg.sigterm_to_exit_seconds is not None and 1.5 <= msg.sigterm_to_exit_seconds < 30
