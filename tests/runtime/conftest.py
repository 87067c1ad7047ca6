"""Shared pieces of the real-process, real-signal tests (tier 2).

Every test trains the toy (``python -m trainer_runtime.toy``) in a real subprocess with the
operator's environment, interrupts it with real signals (``os.kill``), resumes it in a new process
and compares the final ``model.safetensors`` with an uninterrupted run of the same configuration
(computed once per session) tensor by tensor with ``torch.equal``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from trainer_runtime.checkpoint.layout import CheckpointInfo, CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED, TerminationMessage
from trainer_runtime.testing import ToyRun, checkpoint_step, weights_identical

# One configuration for every test, so one uninterrupted reference run serves them all.
MAX_STEPS = 12
SAVE_STEPS = 4
BASE_ARGS = ("--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS), "--seed", "7")
# Generous: the CI box has 2 cores shared with other jobs; a toy run normally takes ~5 s.
RUN_TIMEOUT = 180.0


def toy_args(*, step_sleep: float = 0.0, save_sleep: float = 0.0, extra: tuple = ()) -> list[str]:
    args = list(BASE_ARGS)
    if step_sleep:
        args += ["--step-sleep", str(step_sleep)]
    if save_sleep:
        args += ["--save-sleep", str(save_sleep)]
    return [*args, *extra]


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run every interrupted run must match bit for bit."""

    output_dir: Path
    final_checkpoint: Path

    def checkpoint_bytes(self, step: int) -> int:
        info = CheckpointStore(str(self.output_dir)).inspect(f"checkpoint-{step}")
        assert info.complete, info
        return info.size_bytes


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    root = tmp_path_factory.mktemp("reference")
    run = ToyRun(root / "out", root / "work", args=toy_args()).start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, f"uninterrupted reference run exited with {code}\n{run.tail()}"
    final = root / "out" / f"checkpoint-{MAX_STEPS}"
    assert CheckpointStore(str(root / "out")).inspect(str(final)).complete
    return Reference(root / "out", final)


def assert_preempted(run: ToyRun, code: int, *, min_step: int = 0) -> TerminationMessage:
    """Exit code 75 and a termination message describing a complete JIT checkpoint."""
    assert code == EXIT_PREEMPTED, f"exit code {code}, expected {EXIT_PREEMPTED}\n{run.tail()}"
    msg = run.termination_message()
    assert msg.reason == "preempted", msg
    assert msg.complete is True, msg
    assert msg.checkpoint is not None, msg
    assert checkpoint_step(msg.checkpoint) == msg.step, msg
    # == MAX_STEPS is possible: a kill wait that ends with the last step still saves as a JIT stop.
    assert min_step <= msg.step <= MAX_STEPS, msg
    assert msg.sigterm_to_exit_seconds is not None and msg.sigterm_to_exit_seconds >= 0, msg
    assert msg.attempt == run.attempt, msg
    info = checkpoint_info(run.output_dir, msg.step)
    assert info.complete, f"termination message says complete, inspect says: {info.reason}"
    return msg


def checkpoint_info(output_dir: Path, step: int) -> CheckpointInfo:
    return CheckpointStore(str(output_dir)).inspect(f"checkpoint-{step}")


def resume_to_end(
    output_dir: Path, workdir: Path, *, attempt: int, expect_first_step: int, **kw: object
) -> ToyRun:
    """Resume with PREEMPTIBLE_RESUME_FROM=latest in a new process and run to completion."""
    run = ToyRun(
        output_dir, workdir, args=toy_args(), attempt=attempt, resume_from="latest", **kw
    ).start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, f"resumed run (attempt {attempt}) exited with {code}\n{run.tail()}"
    first = next(run.steps_begun(), None)
    assert first == expect_first_step, (
        f"resumed run began at step {first}, expected {expect_first_step}\n{run.tail()}"
    )
    return run


def assert_bit_identical(output_dir: Path, reference: Reference) -> None:
    final = output_dir / f"checkpoint-{MAX_STEPS}"
    same, detail = weights_identical(final, reference.final_checkpoint)
    assert same, f"{final} differs from the uninterrupted run: {detail}"
