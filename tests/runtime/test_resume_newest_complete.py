"""Issue 37, with real processes: a resume never trains completed steps again behind the newest
complete checkpoint's back, and a save never replaces a complete checkpoint newer than the one the
run resumed from. Attempt 1 is SIGKILLed once checkpoint-8 is committed (checkpoint-4 and -8
complete, no message: the operator may have heard of checkpoint-4 only).

- The operator passes the older path (``PREEMPTIBLE_RESUME_FROM=.../checkpoint-4``): the runtime
  resumes from checkpoint-8, the newest complete one (before: from checkpoint-4, steps 5-8 trained
  twice, checkpoint-8 replaced).
- The caller passes the older path itself (``resume_from_checkpoint``): honoured, but the save of
  step 8 keeps the complete checkpoint-8 (before: replaced by this run's state of step 8).

Both end bit-identical to the uninterrupted run."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.runtime.conftest import (
    MAX_STEPS,
    RUN_TIMEOUT,
    SAVE_STEPS,
    Reference,
    assert_bit_identical,
    checkpoint_info,
    toy_args,
)
from trainer_runtime.checkpoint.layout import MANIFEST_NAME
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

NEWEST = 2 * SAVE_STEPS  # checkpoint-8
OLDER = SAVE_STEPS  # checkpoint-4


def _manifest(out: Path, step: int) -> dict[str, Any]:
    return json.loads((out / f"checkpoint-{step}" / MANIFEST_NAME).read_text())


def _two_complete_checkpoints(out: Path, workdir: Path) -> dict[str, Any]:
    """Attempt 1, SIGKILLed right after checkpoint-8 is committed; checkpoint-8's manifest."""
    run = ToyRun(out, workdir, args=toy_args(step_sleep=0.3), attempt=1).start()
    try:
        run.wait_for_event("save", step=NEWEST, timeout=RUN_TIMEOUT)
        run.send(signal.SIGKILL)
        assert run.wait(RUN_TIMEOUT) == -signal.SIGKILL, run.tail()
    finally:
        run.kill()
    for step in (OLDER, NEWEST):
        assert checkpoint_info(out, step).complete, checkpoint_info(out, step)
    return _manifest(out, NEWEST)


def test_an_older_path_from_the_operator_resumes_from_the_newest_complete_checkpoint(
    tmp_path: Path, reference: Reference
) -> None:
    out = tmp_path / "out"
    before = _two_complete_checkpoints(out, tmp_path / "a1")
    run = ToyRun(
        out,
        tmp_path / "a2",
        args=toy_args(),
        attempt=2,
        resume_from=str(out / f"checkpoint-{OLDER}"),
    ).start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, run.tail()
    first = next(run.steps_begun(), None)
    assert first == NEWEST + 1, f"resumed at step {first}\n{run.tail()}"
    msg = run.termination_message()
    assert msg.resumed_from_step == NEWEST, msg
    assert "is complete and newer: resuming from it" in run.output(), run.tail()
    assert _manifest(out, NEWEST) == before  # not written again
    assert _manifest(out, MAX_STEPS)["attempt"] == 2
    assert_bit_identical(out, reference)


def test_a_save_never_replaces_a_complete_checkpoint_newer_than_the_resumed_one(
    tmp_path: Path, reference: Reference
) -> None:
    out = tmp_path / "out"
    before = _two_complete_checkpoints(out, tmp_path / "a1")
    older = str(out / f"checkpoint-{OLDER}")
    # The caller's own path (the toy passes it to train(resume_from_checkpoint=...)) is honoured.
    run = ToyRun(
        out, tmp_path / "a2", args=[*toy_args(), "--resume-from", older], attempt=2
    ).start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, run.tail()
    first = next(run.steps_begun(), None)
    assert first == OLDER + 1, f"resumed at step {first}\n{run.tail()}"
    assert f"not saving step {NEWEST}" in run.output(), run.tail()
    assert _manifest(out, NEWEST) == before  # kept as attempt 1 committed it
    assert _manifest(out, MAX_STEPS)["attempt"] == 2
    assert_bit_identical(out, reference)
