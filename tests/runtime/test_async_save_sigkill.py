"""Asynchronous periodic checkpoints (save_async, on by default under the operator's environment)
under real SIGKILLs at random moments of their background writes.

Each attempt is killed while the writer thread is writing checkpoint-<step> and training has
already moved past that step (proof that the write runs in the background); the directory must
read as incomplete, resume must skip it, and the run, resumed until done, must end bit-identical to
the uninterrupted reference. PREEMPTIBLE_TRIAL_SEED replays the random moments.
"""

from __future__ import annotations

import os
import random
import signal
import time
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
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

# Every file of a checkpoint takes this long to close (slowfile://): a background write of the
# toy's ~10 files lasts seconds, while its steps take milliseconds.
SAVE_SLEEP = 0.8


def _kill_during_background_write(
    out: Path, work: Path, rng: random.Random, *, attempt: int, step: int
) -> None:
    latest = CheckpointStore(str(out)).latest_complete() if out.exists() else None
    run = ToyRun(
        out,
        work,
        args=toy_args(save_sleep=SAVE_SLEEP),
        attempt=attempt,
        resume_from="latest" if latest else "",
    ).start()
    try:
        run.wait_for_event("save_begin", step=step, timeout=RUN_TIMEOUT)
        # Training goes on while checkpoint-<step> is written: the next step begins.
        run.wait_for_event("step_begin", step=step + 1, timeout=RUN_TIMEOUT)
        time.sleep(rng.uniform(0.0, 1.0))
        run.send(signal.SIGKILL)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == -signal.SIGKILL, f"exit status {code}\n{run.tail()}"
    info = checkpoint_info(out, step)
    assert not info.complete and info.reason and SENTINEL_NAME in info.reason, (
        f"checkpoint-{step} should be an interrupted background write: {info}\n{run.tail()}"
    )
    begun = list(run.steps_begun())
    assert step + 1 in begun, f"training did not continue during the write: {begun}"


def test_sigkill_during_background_writes_resume_skips_them(
    tmp_path: Path, reference: Reference
) -> None:
    seed = int(os.environ.get("PREEMPTIBLE_TRIAL_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"PREEMPTIBLE_TRIAL_SEED={seed}")
    out, work = tmp_path / "out", tmp_path / "work"

    # Attempt 1: killed while checkpoint-8 is written in the background (checkpoint-4 committed).
    _kill_during_background_write(out, work, rng, attempt=1, step=2 * SAVE_STEPS)
    assert checkpoint_info(out, SAVE_STEPS).complete
    # Attempt 2 resumes from checkpoint-4 (skipping the incomplete 8) and is killed again while
    # its own background write of checkpoint-8 is in flight.
    _kill_during_background_write(out, work, rng, attempt=2, step=2 * SAVE_STEPS)
    assert CheckpointStore(str(out)).latest_complete().step == SAVE_STEPS  # type: ignore[union-attr]

    # Attempt 3 resumes after step 4 again and finishes; every checkpoint is complete at the end.
    resume_to_end(out, tmp_path, attempt=3, expect_first_step=SAVE_STEPS + 1)
    assert checkpoint_info(out, 2 * SAVE_STEPS).complete, "step 8 is rewritten by the resume"
    assert_bit_identical(out, reference)
