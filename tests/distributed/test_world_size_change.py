"""Resuming a 2-rank checkpoint with another number of ranks: the data position is re-sharded when
the consumed samples divide evenly, otherwise the resume is refused naming both sizes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.distributed.conftest import RUN_TIMEOUT, SAVE_STEPS, WORLD_SIZE, Reference, toy_args
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(400)]


def _copy_checkpoint(reference: Reference, out: Path) -> None:
    out.mkdir(parents=True)
    name = f"checkpoint-{SAVE_STEPS}"
    shutil.copytree(reference.output_dir / name, out / name)


def test_one_rank_resumes_a_two_rank_checkpoint_at_the_same_sample(
    tmp_path: Path, reference: Reference
) -> None:
    out = tmp_path / "out"
    _copy_checkpoint(reference, out)
    # 2 ranks x 4 micro-batches x 8 samples = the first 64 samples: batch 8 of a single rank.
    run = ToyRun(out, tmp_path, args=toy_args(), attempt=2, resume_from="latest").start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 0, run.tail()
    assert next(run.steps_begun()) == SAVE_STEPS + 1
    found = re.search(
        r"(\d+) rank\(s\) x 8 samples, this run has 1 x 8: data position "
        r"re-sharded from batch (\d+) to batch (\d+)",
        run.output(),
    )
    assert found, run.tail()
    assert found.groups() == (str(WORLD_SIZE), str(SAVE_STEPS), str(SAVE_STEPS * WORLD_SIZE))


def test_resume_refused_when_the_position_cannot_carry_over(
    tmp_path: Path, reference: Reference
) -> None:
    out = tmp_path / "out"
    _copy_checkpoint(reference, out)
    # 64 samples consumed; one rank of 24 cannot resume at a whole micro-batch.
    args = [*toy_args(), "--batch-size", "24"]
    run = ToyRun(out, tmp_path, args=args, attempt=2, resume_from="latest").start()
    code = run.wait(RUN_TIMEOUT)
    assert code == 1, run.tail()
    msg = run.termination_message()
    assert msg.reason == "failed" and msg.message, msg
    assert f"{WORLD_SIZE} rank(s) x 8" in msg.message and "1 rank(s) x 24" in msg.message, msg
    assert list(run.steps_begun()) == [], "no step may run after a refused resume"
