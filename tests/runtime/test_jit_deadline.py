"""JIT stops that fit the deadline, under real SIGTERMs (real toy processes, real files):

- ``micro_batch``: a SIGTERM in the middle of a gradient-accumulation step drops the partial
  accumulation and saves the previous step within one micro-batch; the resumed run is
  bit-identical to an uninterrupted one (the dropped micro-batches are trained again);
- ``finish_step`` with a grace shorter than the rest of the step + the save falls back to that;
- a SIGTERM during a long evaluation is met within the grace (the evaluation is abandoned, and
  run again after resume);
- a grace shorter than the save: nothing is written, exit at once with ``deadline_too_short``.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.runtime.conftest import RUN_TIMEOUT
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED, REASON_DEADLINE_TOO_SHORT
from trainer_runtime.testing import ToyRun, weights_identical

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(400)]

MAX_STEPS = 8
SAVE_STEPS = 4
GA = 4
EVAL_STEPS = 4
# One configuration (and one reference run) for every test: 4 micro-batches per step, an
# evaluation every 4 steps (8 batches of 8), sleeps only slow the run down, never change it.
BASE = (
    "--max-steps",
    str(MAX_STEPS),
    "--save-steps",
    str(SAVE_STEPS),
    "--seed",
    "5",
    "--gradient-accumulation-steps",
    str(GA),
    "--eval-steps",
    str(EVAL_STEPS),
)


def _args(*extra: str) -> list[str]:
    return [*BASE, *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ga-reference")
    run = ToyRun(root / "out", root, args=_args()).start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, run.tail()
    return root / "out" / f"checkpoint-{MAX_STEPS}"


def _resume_and_compare(out: Path, workdir: Path, reference: Path, first_step: int) -> ToyRun:
    run = ToyRun(out, workdir, args=_args(), attempt=2, resume_from="latest").start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, run.tail()
    begun = list(run.steps_begun())
    assert begun and begun[0] == first_step, f"resumed at {begun[:1]}, expected {first_step}"
    same, detail = weights_identical(out / f"checkpoint-{MAX_STEPS}", reference)
    assert same, f"resumed run differs from the uninterrupted one: {detail}"
    return run


def _sigterm_at(run: ToyRun, event: str, step: int | None = None) -> float:
    run.wait_for_event(event, step=step, timeout=RUN_TIMEOUT)
    return run.send(signal.SIGTERM)


def test_micro_batch_policy_saves_the_previous_step_within_one_micro_batch(
    tmp_path: Path, reference: Path
) -> None:
    micro = 0.4  # every micro-batch's forward pass sleeps this long: a step takes >= 1.6 s
    out = tmp_path / "out"
    run = ToyRun(
        out, tmp_path, args=_args("--step-sleep", str(micro), "--stop-policy", "micro_batch")
    ).start()
    try:
        # After the first micro-batch of step 3: three more would follow under finish_step.
        _sigterm_at(run, "substep_end", step=3)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == EXIT_PREEMPTED, run.tail()
    msg = run.termination_message()
    assert msg.reason == "preempted" and msg.complete and msg.stop == "micro_batch", msg
    assert msg.step == 2, f"the last completed step is 2, the JIT checkpoint is {msg.step}"
    assert 3 not in [e["step"] for e in run.events() if e["event"] == "step_end"]
    # Acted at the first boundary after kill_wait (0.2 s < one micro-batch): one more
    # micro-batch of step 3 at most ran after the SIGTERM, then step 2 was saved at once.
    substeps = [e for e in run.events() if e["event"] == "substep_end" and e["step"] == 3]
    assert len(substeps) <= 2, f"{len(substeps)} micro-batches of step 3 ended: not stopped"
    assert msg.sigterm_to_exit_seconds is not None
    assert msg.sigterm_to_exit_seconds < 0.2 + 2 * micro + 1.5, msg
    assert msg.micro_batch_seconds is not None and msg.micro_batch_seconds.max >= micro, msg
    _resume_and_compare(out, tmp_path, reference, first_step=3)


def test_finish_step_falls_back_to_the_micro_batch_stop_when_the_step_cannot_fit(
    tmp_path: Path, reference: Path
) -> None:
    # (Without a deadline finish_step finishes the step: tests/unit/runtime/test_jit.py.)
    grace = 1.5
    # A 4-micro-batch step takes ~2.4 s; after the SIGTERM (once one micro-batch is done)
    # the rest of it needs ~1.8 s, more than the 1.5 s grace.
    micro = 0.6
    out = tmp_path / "out"
    run = ToyRun(
        out,
        tmp_path,
        args=_args("--step-sleep", str(micro), "--stop-policy", "finish_step"),
        grace_seconds=grace,
    ).start()
    try:
        _sigterm_at(run, "substep_end", step=3)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == EXIT_PREEMPTED, run.tail()
    msg = run.termination_message()
    assert msg.reason == "preempted" and msg.complete, msg
    assert msg.step == 2 and msg.stop == "micro_batch", msg
    assert msg.sigterm_to_exit_seconds is not None and msg.sigterm_to_exit_seconds < grace, msg
    _resume_and_compare(out, tmp_path, reference, first_step=3)


def test_sigterm_during_a_long_evaluation_is_met_within_the_grace(
    tmp_path: Path, reference: Path
) -> None:
    # The evaluation at step 4 has 8 batches of 0.5 s (4 s); the grace is 2.5 s.
    grace = 2.5
    out = tmp_path / "out"
    run = ToyRun(out, tmp_path, args=_args("--eval-sleep", "0.5"), grace_seconds=grace).start()
    try:
        _sigterm_at(run, "eval_batch")
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == EXIT_PREEMPTED, run.tail()
    msg = run.termination_message()
    assert msg.reason == "preempted" and msg.complete and msg.stop == "evaluation", msg
    assert msg.step == EVAL_STEPS, msg
    assert msg.sigterm_to_exit_seconds is not None and msg.sigterm_to_exit_seconds < grace, msg
    assert not [e for e in run.events() if e["event"] == "evaluate"], "evaluation not abandoned"
    resumed = _resume_and_compare(out, tmp_path, reference, first_step=EVAL_STEPS + 1)
    evaluated = [e["step"] for e in resumed.events() if e["event"] == "evaluate"]
    assert evaluated[:1] == [EVAL_STEPS], f"the abandoned evaluation did not run again: {evaluated}"


def test_grace_shorter_than_the_save_exits_without_writing(tmp_path: Path) -> None:
    # Each checkpoint file takes 0.3 s to write: the periodic save of step 4 takes seconds, the
    # grace is 1 s, so the JIT save of step 6 cannot finish: it is not started. The periodic save
    # blocks (save_async off) so that the SIGTERM lands after it, at a known step.
    grace = 1.0
    out = tmp_path / "out"
    run = ToyRun(
        out,
        tmp_path,
        args=_args("--step-sleep", "0.1", "--save-sleep", "0.3", "--save-async", "false"),
        grace_seconds=grace,
    ).start()
    try:
        run.wait_for_event("save", step=SAVE_STEPS, timeout=RUN_TIMEOUT)
        _sigterm_at(run, "step_begin", step=SAVE_STEPS + 2)
        code = run.wait(RUN_TIMEOUT)
    finally:
        run.kill()
    assert code == EXIT_PREEMPTED, run.tail()
    msg = run.termination_message()
    assert msg.reason == REASON_DEADLINE_TOO_SHORT, msg
    assert msg.checkpoint is None and not msg.complete and msg.stop == "no_save", msg
    assert msg.step >= SAVE_STEPS + 1 and msg.message and "deadline too short" in msg.message
    assert msg.sigterm_to_exit_seconds is not None and msg.sigterm_to_exit_seconds < grace, msg
    steps = [c.step for c in CheckpointStore(str(out)).list()]
    assert steps == [SAVE_STEPS], f"only the periodic checkpoint may exist, found {steps}"
    begins = [e["step"] for e in run.events() if e["event"] == "save_begin"]
    assert begins == [SAVE_STEPS], f"a JIT save was started: {begins}"
