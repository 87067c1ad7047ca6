"""A periodic save that falls due after a real SIGTERM is the JIT save (issue 37, item 4).

What tells the paths apart is part of the product: every checkpoint's runtime record
(``preemptible_state.json``) says how it was written, ``save_kind`` ``jit`` for the JIT path,
``blocking`` or ``background`` for a periodic save. One save at that step (one ``on_save``),
written by the JIT path, the run stopped there with exit 75, and the resumed run bit-identical.
"""

from __future__ import annotations

import json
import signal
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
from trainer_runtime.checkpoint.layout import RUNTIME_STATE_NAME
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(400)]


def _save_kind(output_dir: Path, step: int) -> str:
    record = json.loads((output_dir / f"checkpoint-{step}" / RUNTIME_STATE_NAME).read_text())
    return str(record.get("save_kind"))


@pytest.mark.parametrize(
    ("kill_wait", "save_async"),
    [
        # kill_wait over before the step ends: the stop acts at this very boundary
        (0.2, "false"),
        # the operator's default for one process: background periodic saves
        (0.2, "true"),
    ],
)
def test_save_due_after_sigterm_is_the_jit_save(
    tmp_path: Path, reference: Reference, kill_wait: float, save_async: str
) -> None:
    out = tmp_path / "out"
    run = ToyRun(
        out,
        tmp_path,
        args=toy_args(step_sleep=0.5, extra=("--save-async", save_async)),
        kill_wait=kill_wait,
    ).start()
    try:
        # Step SAVE_STEPS is a periodic save step; the SIGTERM lands in its forward pass.
        run.wait_for_event("step_begin", step=SAVE_STEPS, timeout=RUN_TIMEOUT)
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code)
    assert msg.step == SAVE_STEPS, f"the stop must take the due save's step: {msg}"
    assert max(run.steps_begun()) == SAVE_STEPS, "no step may start after the due save"
    saves = [e for e in run.events() if e["event"] == "save" and e["step"] == SAVE_STEPS]
    assert len(saves) == 1, f"step {SAVE_STEPS} saved {len(saves)} times\n{run.tail()}"
    kind = _save_kind(out, SAVE_STEPS)
    assert kind == "jit", f"checkpoint-{SAVE_STEPS} was written as a {kind} save, not the JIT one"
    assert msg.stop == "step", msg
    resume_to_end(out, tmp_path, attempt=2, expect_first_step=SAVE_STEPS + 1)
    assert_bit_identical(out, reference)


def test_save_due_during_the_kill_wait_is_left_to_the_jit_save(
    tmp_path: Path, reference: Reference
) -> None:
    # kill_wait (2 s) still running when step SAVE_STEPS's save falls due: training goes on
    # through the kill wait (as transformers does), and that save is not written as a periodic
    # one followed by the JIT one a few steps later: the JIT save of the stop step is the only
    # save after the SIGTERM.
    out = tmp_path / "out"
    run = ToyRun(
        out, tmp_path, args=toy_args(step_sleep=0.5, extra=("--save-async", "true")), kill_wait=2.0
    ).start()
    try:
        run.wait_for_event("step_begin", step=SAVE_STEPS, timeout=RUN_TIMEOUT)
        run.send(signal.SIGTERM)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    msg = assert_preempted(run, code)
    assert msg.step > SAVE_STEPS, f"the kill wait must still be honoured: {msg}"
    saves = [e["step"] for e in run.events() if e["event"] == "save"]
    assert saves == [msg.step], f"saves after the SIGTERM: {saves}, expected only the JIT one"
    assert not (out / f"checkpoint-{SAVE_STEPS}").exists()
    assert _save_kind(out, msg.step) == "jit"
    resume_to_end(out, tmp_path, attempt=2, expect_first_step=msg.step + 1)
    assert_bit_identical(out, reference)
