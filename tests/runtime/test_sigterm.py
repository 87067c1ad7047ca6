"""A real SIGTERM at chosen moments: JIT checkpoint, exit 75, resume, bit-identical result."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.runtime.conftest import (
    RUN_TIMEOUT,
    SAVE_STEPS,
    Reference,
    assert_bit_identical,
    assert_preempted,
    resume_to_end,
    toy_args,
)
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(400)]


def test_sigterm_before_first_step(tmp_path: Path, reference: Reference) -> None:
    # The handler is in place once training begins; the toy idles 1.5 s before step 1.
    run = ToyRun(
        tmp_path / "out", tmp_path, args=toy_args(extra=("--train-begin-sleep", "1.5"))
    ).start()
    try:
        run.wait_for_event("train_begin", timeout=RUN_TIMEOUT)
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code)
    assert msg.step == 0, f"SIGTERM before the first step must save step 0, got {msg}"
    assert list(run.steps_begun()) == [], "no step may start after the stop was decided"
    resume_to_end(tmp_path / "out", tmp_path, attempt=2, expect_first_step=1)
    assert_bit_identical(tmp_path / "out", reference)


def test_sigterm_mid_step(tmp_path: Path, reference: Reference) -> None:
    run = ToyRun(tmp_path / "out", tmp_path, args=toy_args(step_sleep=0.4)).start()
    try:
        # Step 6 is between the periodic saves at 4 and 8; its forward pass sleeps 0.4 s.
        run.wait_for_event("step_begin", step=6, timeout=RUN_TIMEOUT)
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code, min_step=6)
    ended = [e["step"] for e in run.events() if e["event"] == "step_end"]
    assert 6 in ended, "the step in flight when SIGTERM arrived must be finished"
    assert max(run.steps_begun()) == msg.step, "no step may start after the JIT stop step"
    resume_to_end(tmp_path / "out", tmp_path, attempt=2, expect_first_step=msg.step + 1)
    assert_bit_identical(tmp_path / "out", reference)


def test_sigterm_during_periodic_save(tmp_path: Path, reference: Reference) -> None:
    # Every checkpoint file takes 0.4 s to write: the save of step 8 lasts a few seconds. A
    # blocking periodic save (save_async=False; under the operator one process defaults to
    # background saves, whose JIT stop tests/unit/runtime/test_save_async.py and
    # tests/runtime/test_async_save_sigkill.py cover).
    run = ToyRun(
        tmp_path / "out",
        tmp_path,
        args=toy_args(save_sleep=0.4, extra=("--save-async", "false")),
    ).start()
    try:
        run.wait_for_event("save_begin", step=2 * SAVE_STEPS, timeout=RUN_TIMEOUT)
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code)
    assert msg.step == 2 * SAVE_STEPS, f"the periodic save in flight is the JIT checkpoint: {msg}"
    begins = [e for e in run.events() if e["event"] == "save_begin" and e["step"] == msg.step]
    assert len(begins) == 1, f"step {msg.step} was saved {len(begins)} times, expected once"
    steps = [c.step for c in CheckpointStore(str(tmp_path / "out")).list()]
    assert steps == [SAVE_STEPS, 2 * SAVE_STEPS], steps
    resume_to_end(tmp_path / "out", tmp_path, attempt=2, expect_first_step=msg.step + 1)
    assert_bit_identical(tmp_path / "out", reference)


@pytest.mark.parametrize("gap", [0.05, 1.4], ids=["back-to-back", "second-during-kill-wait"])
def test_sigterm_twice(tmp_path: Path, reference: Reference, gap: float) -> None:
    """A second SIGTERM neither kills the process nor restarts the kill-wait clock."""
    kill_wait, step_sleep = 1.5, 0.4
    run = ToyRun(
        tmp_path / "out", tmp_path, args=toy_args(step_sleep=step_sleep), kill_wait=kill_wait
    ).start()
    try:
        run.wait_for_event("step_begin", step=2, timeout=RUN_TIMEOUT)
        first = time.time()
        run.send(signal.SIGTERM)
        time.sleep(gap)
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code, min_step=2)
    # No step begins once kill_wait has passed since the FIRST signal; had the second one
    # restarted the clock, steps would go on beginning until first + gap + kill_wait.
    last_begin = max(e["time"] for e in run.events() if e["event"] == "step_begin")
    assert last_begin - first < kill_wait + 0.6, (
        f"a step began {last_begin - first:.2f}s after the first SIGTERM: the second SIGTERM "
        f"restarted the {kill_wait}s kill wait"
    )
    assert msg.sigterm_to_exit_seconds is not None
    assert msg.sigterm_to_exit_seconds >= kill_wait, msg
    complete = [c.step for c in CheckpointStore(str(tmp_path / "out")).list() if c.complete]
    assert complete[-1] == msg.step and complete.count(msg.step) == 1, complete
    resume_to_end(tmp_path / "out", tmp_path, attempt=2, expect_first_step=msg.step + 1)
    assert_bit_identical(tmp_path / "out", reference)


def test_default_kill_wait_is_honoured(tmp_path: Path, reference: Reference) -> None:
    """Without PREEMPTIBLE_KILL_WAIT_SECONDS the runtime keeps training 3 s before it stops."""
    run = ToyRun(tmp_path / "out", tmp_path, args=toy_args(step_sleep=0.4), kill_wait=None).start()
    try:
        run.wait_for_event("step_begin", step=2, timeout=RUN_TIMEOUT)
        sent = time.time()
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code, min_step=2)
    assert msg.sigterm_to_exit_seconds is not None and msg.sigterm_to_exit_seconds >= 3.0, msg
    later = [e["step"] for e in run.events() if e["event"] == "step_end" and e["time"] > sent + 2.0]
    assert later, "training must go on during the 3 s kill wait (no step ended 2 s after SIGTERM)"
    resume_to_end(tmp_path / "out", tmp_path, attempt=2, expect_first_step=msg.step + 1)
    assert_bit_identical(tmp_path / "out", reference)
