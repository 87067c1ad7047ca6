"""Where a process writes its termination message: one file per pod (local rank 0), or one per
worker under `trainer-runtime launch`, which merges them."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_runtime.protocol import (
    ENV_TERMINATION_DIR,
    ENV_TERMINATION_LOG,
    TerminationMessage,
    read_termination_message,
    termination_message_path,
    write_termination_message,
    writes_termination_message,
)


@pytest.mark.parametrize(
    ("env", "writes", "path"),
    [
        ({}, True, None),  # no file to write (and /dev/termination-log absent here)
        ({ENV_TERMINATION_LOG: "/t/log"}, True, "/t/log"),
        ({ENV_TERMINATION_LOG: "/t/log", "LOCAL_RANK": "0"}, True, "/t/log"),
        # Plain torchrun / accelerate launch: the other workers keep quiet (one file per pod).
        ({ENV_TERMINATION_LOG: "/t/log", "LOCAL_RANK": "3"}, False, "/t/log"),
        # Under our launcher every worker writes its own file.
        ({ENV_TERMINATION_DIR: "/w", "LOCAL_RANK": "3", ENV_TERMINATION_LOG: "/t/log"}, True,
         "/w/local-rank-3.json"),
        ({ENV_TERMINATION_DIR: "/w"}, True, "/w/local-rank-0.json"),
        ({"LOCAL_RANK": "x"}, True, None),
    ],
)  # fmt: skip
def test_termination_path(env: dict[str, str], writes: bool, path: str | None) -> None:
    if path is None and Path("/dev/termination-log").exists():
        pytest.skip("this machine has /dev/termination-log")
    assert writes_termination_message(env) is writes
    assert termination_message_path(env) == path


def test_a_worker_under_the_launcher_writes_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_TERMINATION_DIR, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    written = write_termination_message(TerminationMessage(reason="preempted", step=4))
    assert written == str(tmp_path / "local-rank-1.json")
    msg = read_termination_message((tmp_path / "local-rank-1.json").read_text())
    assert msg is not None and msg.step == 4
