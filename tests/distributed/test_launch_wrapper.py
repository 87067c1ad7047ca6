"""The launcher process itself, with a stand-in for torchrun (a tiny Python child): it forwards the
first SIGTERM exactly once, ignores later ones, and maps the exit code from the termination message
written during the launch. Torch-free and fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_runtime.protocol import EXIT_PREEMPTED, TerminationMessage

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(120)]

# Stands in for torchrun: counts SIGTERMs for 1.5 s after the first, then "saves" and exits 1 the
# way torchrun does when its workers exit 75.
CHILD = r"""
import json, signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(time.monotonic()))
open(sys.argv[1] + ".ready", "w").close()
while not got:
    time.sleep(0.01)
time.sleep(1.5)
if sys.argv[2] == "preempted":
    with open(sys.argv[3], "w") as fh:
        fh.write(json.dumps({"reason": "preempted", "step": 7, "complete": True}))
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
    term.write_text(TerminationMessage(reason="preempted", step=1).model_dump_json())
    old = time.time() - 3600
    os.utime(term, (old, old))  # a stale message of an earlier run must not count
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
