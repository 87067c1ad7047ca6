"""Multi-rank runs under real signals (CPU, gloo): shared configuration and the reference run.

Every test trains the toy with the same configuration on ``WORLD_SIZE`` ranks, so one
uninterrupted run (computed once per session) is the reference every interrupted-and-resumed run
must match bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.distributed.ranks import RankedRun
from trainer_runtime.checkpoint.layout import CheckpointStore

WORLD_SIZE = 2
MAX_STEPS = 12
SAVE_STEPS = 4
BASE_ARGS = ("--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS), "--seed", "11")
# Generous: 2 shared cores; two ranks normally finish this in ~20 s.
RUN_TIMEOUT = 240.0


def toy_args(*, step_sleep: float = 0.0, save_sleep: float = 0.0) -> list[str]:
    args = list(BASE_ARGS)
    if step_sleep:
        args += ["--step-sleep", str(step_sleep)]
    if save_sleep:
        args += ["--save-sleep", str(save_sleep)]
    return args


@dataclass(frozen=True)
class Reference:
    output_dir: Path

    @property
    def final_checkpoint(self) -> Path:
        return self.output_dir / f"checkpoint-{MAX_STEPS}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    root = tmp_path_factory.mktemp("ddp-reference")
    with RankedRun(root / "out", root, world_size=WORLD_SIZE, args=toy_args()) as run:
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD_SIZE, f"reference run exited {codes}\n{run.tails()}"
    info = CheckpointStore(str(root / "out")).inspect(f"checkpoint-{MAX_STEPS}")
    assert info.complete, info
    assert info.manifest is not None and info.manifest["world_size"] == WORLD_SIZE, info.manifest
    return Reference(root / "out")


def resume_to_end(output_dir: Path, workdir: Path, *, attempt: int, first_step: int) -> RankedRun:
    """Resume every rank from the newest complete checkpoint and train to the end."""
    with RankedRun(
        output_dir,
        workdir,
        world_size=WORLD_SIZE,
        args=toy_args(),
        attempt=attempt,
        resume_from="latest",
    ) as run:
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD_SIZE, f"resumed run exited {codes}\n{run.tails()}"
    for rank in range(WORLD_SIZE):
        begun = run.steps_begun(rank)
        assert begun and begun[0] == first_step, (
            f"rank {rank} resumed at step {begun[:1]}, expected {first_step}\n{run.tails()}"
        )
    return run
