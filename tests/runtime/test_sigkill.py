"""SIGKILL during a save: the checkpoint stays incomplete, inspect says why, resume skips it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.conftest import (
    RUN_TIMEOUT,
    SAVE_STEPS,
    Reference,
    assert_bit_identical,
    checkpoint_info,
    resume_to_end,
    toy_args,
)
from trainer_runtime.checkpoint.layout import SENTINEL_NAME
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(400)]


def _inspect(output_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer_runtime.cli", "inspect", str(output_dir), *extra],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_sigkill_during_save_leaves_incomplete_checkpoint_that_resume_skips(
    tmp_path: Path, reference: Reference
) -> None:
    out = tmp_path / "out"
    run = ToyRun(out, tmp_path, args=toy_args(save_sleep=0.3)).start()
    try:
        run.wait_for_event("save_begin", step=2 * SAVE_STEPS, timeout=RUN_TIMEOUT)
        run.send(signal.SIGKILL)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == -signal.SIGKILL, f"exit status {code}\n{run.tail()}"
    assert not run.termination_log.exists(), "a SIGKILLed process cannot write a message"

    # The interrupted save is incomplete, and says why; the one before it is intact.
    broken = checkpoint_info(out, 2 * SAVE_STEPS)
    assert not broken.complete and broken.reason and SENTINEL_NAME in broken.reason, broken
    assert checkpoint_info(out, SAVE_STEPS).complete

    table = _inspect(out)
    assert table.returncode == 0, table.stderr
    line = next(ln for ln in table.stdout.splitlines() if f"checkpoint-{2 * SAVE_STEPS}" in ln)
    assert "INCOMPLETE" in line and SENTINEL_NAME in line, table.stdout
    assert f"newest complete: checkpoint-{SAVE_STEPS}" in table.stdout, table.stdout
    doc = json.loads(_inspect(out, "--json").stdout)
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert by_step[2 * SAVE_STEPS]["complete"] is False
    assert SENTINEL_NAME in by_step[2 * SAVE_STEPS]["reason"]
    assert by_step[SAVE_STEPS]["complete"] is True
    assert doc["latest_complete"].endswith(f"checkpoint-{SAVE_STEPS}")

    # "latest" means the newest COMPLETE checkpoint: the resumed run starts after step 4.
    resumed = resume_to_end(out, tmp_path, attempt=2, expect_first_step=SAVE_STEPS + 1)
    assert resumed.returncode == 0
    assert checkpoint_info(out, 2 * SAVE_STEPS).complete, "step 8 is rewritten by the resume"
    assert_bit_identical(out, reference)
