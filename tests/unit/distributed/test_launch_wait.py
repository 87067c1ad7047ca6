"""How long the launcher waits for torchrun's agent (real child processes, no torch): never past
its own end before the grace, nor long after the agent's record says every worker ended."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trainer_runtime.distributed.launch import _wait_for_agent, launcher_end_seconds


def _child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code])


def test_an_agent_that_ends_gives_its_code() -> None:
    proc = _child("import sys; sys.exit(3)")
    assert _wait_for_agent(proc, [], None) == 3


def test_the_launcher_stops_waiting_before_the_grace_ends() -> None:
    proc = _child("import time; time.sleep(60)")
    try:
        grace = 4.0  # launcher's end: 3 s after the SIGTERM
        signalled = [time.monotonic() - 1.0]
        started = time.monotonic()
        assert _wait_for_agent(proc, signalled, grace) is None
        waited = time.monotonic() - started
        assert launcher_end_seconds(grace) - 1.0 - 0.1 <= waited < grace - 1.0, waited
    finally:
        proc.kill()
        proc.wait()


def test_an_agent_whose_exit_hangs_after_its_record_is_not_waited_for(tmp_path: Path) -> None:
    record = tmp_path / "agent.json"
    proc = _child(f"import time; open({str(record)!r}, 'w').write('{{}}'); time.sleep(60)")
    try:
        started = time.monotonic()
        assert _wait_for_agent(proc, [], None, str(record)) is None
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
        proc.wait()
