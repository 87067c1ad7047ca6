"""Two ranks, stop policy micro_batch, SIGTERM to one rank in the middle of a gradient-accumulation
step: both ranks agree at the next micro-batch boundary to drop the partial step and save the
previous one; the resumed run is bit-identical to an uninterrupted 2-rank run."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.distributed.conftest import RUN_TIMEOUT
from tests.distributed.ranks import RankedRun
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED
from trainer_runtime.testing import weights_identical

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

WORLD = 2
MAX_STEPS = 6
ARGS = [
    "--max-steps",
    str(MAX_STEPS),
    "--save-steps",
    "3",
    "--seed",
    "13",
    "--gradient-accumulation-steps",
    "4",
    "--stop-policy",
    "micro_batch",
]


def _run_to_end(out: Path, workdir: Path, **kw: object) -> RankedRun:
    with RankedRun(out, workdir, world_size=WORLD, args=ARGS, **kw) as run:  # type: ignore[arg-type]
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD, f"exit codes {codes}\n{run.tails()}"
    return run


def test_two_ranks_drop_the_partial_step_together(tmp_path: Path) -> None:
    _run_to_end(tmp_path / "reference", tmp_path / "reference-logs")
    out = tmp_path / "out"
    with RankedRun(
        out, tmp_path / "logs", world_size=WORLD, args=[*ARGS, "--step-sleep", "0.3"]
    ) as run:
        # Rank 1 only: the agreement at the micro-batch boundary must carry it to rank 0.
        run.ranks[1].wait_for_event("substep_end", step=3, timeout=RUN_TIMEOUT)
        run.send(1, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [EXIT_PREEMPTED] * WORLD, f"exit codes {codes}\n{run.tails()}"
    msg = run.ranks[0].termination_message()
    assert msg.reason == "preempted" and msg.complete and msg.stop == "micro_batch", msg
    assert msg.step == 2, msg
    for rank in range(WORLD):
        assert run.steps_ended(rank)[-1] == 2, f"rank {rank} finished a step after the stop"
    info = CheckpointStore(str(out)).inspect("checkpoint-2")
    assert info.complete and info.manifest is not None and info.manifest["world_size"] == WORLD

    resumed = _run_to_end(out, tmp_path / "logs", attempt=2, resume_from="latest")
    assert all(resumed.steps_begun(r)[0] == 3 for r in range(WORLD)), resumed.tails()
    same, detail = weights_identical(
        out / f"checkpoint-{MAX_STEPS}", tmp_path / "reference" / f"checkpoint-{MAX_STEPS}"
    )
    assert same, f"resumed 2-rank run differs from the uninterrupted one: {detail}"
