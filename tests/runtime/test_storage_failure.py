"""Storage failing during a save: a clear error naming the path, the failed save's partial
directory removed, and the previous checkpoint stays complete and resumable."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.conftest import (
    MAX_STEPS,
    RUN_TIMEOUT,
    SAVE_STEPS,
    Reference,
    assert_bit_identical,
    checkpoint_info,
    resume_to_end,
    toy_args,
)
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(400)]


def test_disk_full_during_save(tmp_path: Path, reference: Reference) -> None:
    out = tmp_path / "out"
    # Room for the first checkpoint and half of the second one.
    budget = int(reference.checkpoint_bytes(SAVE_STEPS) * 1.5)
    run = ToyRun(out, tmp_path, args=toy_args(extra=("--enospc-after-bytes", str(budget)))).start()
    try:
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    text = run.output()
    assert code == 1, f"exit code {code}, expected 1 (a real failure)\n{run.tail()}"
    assert "No space left on device" in text, run.tail()
    assert f"checkpoint-{2 * SAVE_STEPS}" in text, "the error must name the path\n" + run.tail()
    msg = run.termination_message()
    assert msg.reason == "failed", msg
    assert msg.message and f"checkpoint-{2 * SAVE_STEPS}" in msg.message, msg

    assert checkpoint_info(out, SAVE_STEPS).complete
    assert not checkpoint_info(out, 2 * SAVE_STEPS).complete
    # the failed save removed its partial directory: its space is back for the next attempt
    assert not (out / f"checkpoint-{2 * SAVE_STEPS}").exists()
    assert "removed the partial checkpoint" in text, run.tail()
    latest = CheckpointStore(str(out)).latest_complete()
    assert latest is not None and latest.step == SAVE_STEPS

    # Space is back: the next attempt resumes from the last complete checkpoint and finishes.
    resume_to_end(out, tmp_path, attempt=2, expect_first_step=SAVE_STEPS + 1)
    assert_bit_identical(out, reference)


def test_output_dir_that_cannot_be_created(tmp_path: Path) -> None:
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a directory\n")
    target = blocker / "out"  # makedirs fails with ENOTDIR, even as root
    run = ToyRun(tmp_path / "unused", tmp_path, args=[*toy_args(), "--output-dir", str(target)])
    run.start()
    try:
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == 1, f"exit code {code}, expected 1\n{run.tail()}"
    assert str(blocker) in run.output(), "the error must name the path\n" + run.tail()
    assert "Traceback" in run.output() or "Error" in run.output()
    assert MAX_STEPS not in list(run.steps_begun())
