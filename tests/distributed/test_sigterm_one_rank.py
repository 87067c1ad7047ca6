"""SIGTERM reaches one rank only: every rank stops at the same step, the JIT checkpoint is
complete, and the resumed run ends bit-identical to an uninterrupted run of the same world size."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import (
    MAX_STEPS,
    RUN_TIMEOUT,
    WORLD_SIZE,
    Reference,
    resume_to_end,
    toy_args,
)
from tests.distributed.ranks import RankedRun
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED
from trainer_runtime.testing import weights_identical

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

STEP_SLEEP = 0.3


def _moment() -> tuple[int, int, float]:
    # Random target rank and step; the seed is printed so a failure can be replayed with
    # PREEMPTIBLE_TEST_SEED=<seed>.
    seed = int(os.environ.get("PREEMPTIBLE_TEST_SEED") or random.SystemRandom().randrange(10**6))
    rng = random.Random(seed)
    rank, step, delay = rng.randrange(WORLD_SIZE), rng.randint(1, MAX_STEPS - 2), rng.random()
    delay *= STEP_SLEEP
    print(f"PREEMPTIBLE_TEST_SEED={seed}: SIGTERM to rank {rank}, {delay:.2f} s into step {step}")
    return rank, step, delay


def test_sigterm_to_one_rank_at_a_random_moment(tmp_path: Path, reference: Reference) -> None:
    target, step, delay = _moment()
    out = tmp_path / "out"
    args = toy_args(step_sleep=STEP_SLEEP)
    with RankedRun(out, tmp_path, world_size=WORLD_SIZE, args=args) as run:
        run.ranks[target].wait_for_event("step_begin", step=step, timeout=RUN_TIMEOUT)
        time.sleep(delay)  # a random moment inside the step's (slow) forward pass
        run.send(target, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [EXIT_PREEMPTED] * WORLD_SIZE, f"exit codes {codes}\n{run.tails()}"

    # Rank 0 (the coordinator) reports the checkpoint; every rank stopped at that same step.
    msg = run.ranks[0].termination_message()
    assert msg.reason == "preempted" and msg.complete, msg
    assert step <= msg.step < MAX_STEPS, msg
    for rank in range(WORLD_SIZE):
        ended = run.steps_ended(rank)
        begun = run.steps_begun(rank)
        assert ended and ended[-1] == msg.step, f"rank {rank} ended at {ended[-1:]}, not {msg.step}"
        assert begun[-1] == msg.step, f"rank {rank} began step {begun[-1]} after the stop step"

    info = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert info.complete, info.reason
    assert info.manifest is not None and info.manifest["world_size"] == WORLD_SIZE
    listed = {f["path"] for f in info.manifest["files"]}
    assert {f"rng_state_{r}.safetensors" for r in range(WORLD_SIZE)} <= listed, listed

    resume_to_end(out, tmp_path, attempt=2, first_step=msg.step + 1)
    same, detail = weights_identical(out / f"checkpoint-{MAX_STEPS}", reference.final_checkpoint)
    assert same, f"resumed run differs from the uninterrupted one: {detail}"


def _run_to_end(out: Path, workdir: Path, world: int, args: list[str], **kw: object) -> RankedRun:
    with RankedRun(out, workdir, world_size=world, args=args, **kw) as run:  # type: ignore[arg-type]
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [0] * world, f"exit codes {codes}\n{run.tails()}"
    return run


def test_four_ranks_sigterm_to_one_rank_resume_bit_identical(tmp_path: Path) -> None:
    # Four processes: the same stop agreement, and a resumed run bit-identical to an
    # uninterrupted 4-rank run. With 3+ ranks the float sums of the gradient all-reduce depend on
    # DDP's bucket order, which DDP changes once after the first step of each process:
    # full_determinism keeps the initial order for the whole run (docs/distributed.md).
    world = 4
    seed = int(os.environ.get("PREEMPTIBLE_TEST_SEED") or random.SystemRandom().randrange(10**6))
    rng = random.Random(seed)
    target, step = rng.randrange(world), rng.randint(2, MAX_STEPS - 3)
    print(f"PREEMPTIBLE_TEST_SEED={seed}: SIGTERM to rank {target} of 4 at step {step}")
    args = [*toy_args(), "--full-determinism"]
    _run_to_end(tmp_path / "reference", tmp_path / "reference-logs", world, args)

    out = tmp_path / "out"
    with RankedRun(
        out, tmp_path / "logs", world_size=world, args=[*args, "--step-sleep", str(STEP_SLEEP)]
    ) as run:
        run.ranks[target].wait_for_event("step_begin", step=step, timeout=RUN_TIMEOUT)
        time.sleep(rng.random() * STEP_SLEEP)
        run.send(target, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [EXIT_PREEMPTED] * world, f"exit codes {codes}\n{run.tails()}"
    msg = run.ranks[0].termination_message()
    assert msg.complete and msg.step >= step, msg
    assert {run.steps_ended(r)[-1] for r in range(world)} == {msg.step}
    info = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert info.complete and info.manifest is not None and info.manifest["world_size"] == world

    resumed = _run_to_end(out, tmp_path / "logs", world, args, attempt=2, resume_from="latest")
    assert all(resumed.steps_begun(r)[0] == msg.step + 1 for r in range(world)), resumed.tails()
    same, detail = weights_identical(
        out / f"checkpoint-{MAX_STEPS}", tmp_path / "reference" / f"checkpoint-{MAX_STEPS}"
    )
    assert same, f"resumed 4-rank run differs from the uninterrupted one: {detail}"
