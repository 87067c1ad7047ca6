"""save_async=True with two DDP ranks: every rank writes its files on a writer thread, the ranks
agree on the commit at a step boundary, and a SIGTERM to one rank while a background write is in
flight ends in a complete JIT checkpoint (the write in flight superseded and removed); the
resumed run, also writing in the background, ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import pytest

from tests.distributed.conftest import (
    MAX_STEPS,
    RUN_TIMEOUT,
    SAVE_STEPS,
    WORLD_SIZE,
    Reference,
    toy_args,
)
from tests.distributed.ranks import RankedRun
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED
from trainer_runtime.testing import weights_identical

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

ASYNC = ["--save-async", "true"]


def test_two_ranks_background_writes_jit_supersedes_and_resume_is_bit_identical(
    tmp_path: Path, reference: Reference
) -> None:
    seed = int(os.environ.get("PREEMPTIBLE_TEST_SEED") or random.SystemRandom().randrange(10**6))
    target = random.Random(seed).randrange(WORLD_SIZE)
    print(f"PREEMPTIBLE_TEST_SEED={seed}: SIGTERM to rank {target}")
    out = tmp_path / "out"
    args = [*toy_args(step_sleep=0.05, save_sleep=1.5), *ASYNC]
    # Each file of a checkpoint takes 1.5 s to close (slowfile://): checkpoint-4's background
    # write lasts over 10 s, so the SIGTERM surely lands while it is in flight.
    with RankedRun(out, tmp_path, world_size=WORLD_SIZE, args=args) as run:
        run.ranks[0].wait_for_event("save_begin", step=SAVE_STEPS, timeout=RUN_TIMEOUT)
        # both ranks train on while checkpoint-4 is written
        for rank in range(WORLD_SIZE):
            run.ranks[rank].wait_for_event("step_begin", step=SAVE_STEPS + 1, timeout=RUN_TIMEOUT)
        run.send(target, signal.SIGTERM)
        codes = run.wait(RUN_TIMEOUT)
    assert codes == [EXIT_PREEMPTED] * WORLD_SIZE, f"exit codes {codes}\n{run.tails()}"
    msg = run.ranks[0].termination_message()
    assert msg.reason == "preempted" and msg.complete and msg.step > SAVE_STEPS, msg
    store = CheckpointStore(str(out))
    # the superseded write's directory is removed once the JIT checkpoint is committed
    assert not (out / f"checkpoint-{SAVE_STEPS}").exists(), store.inspect(
        f"checkpoint-{SAVE_STEPS}"
    )
    jit = store.inspect(f"checkpoint-{msg.step}")
    assert jit.complete and jit.manifest is not None
    listed = {f["path"] for f in jit.manifest["files"]}
    assert {f"rng_state_{r}.safetensors" for r in range(WORLD_SIZE)} <= listed, listed

    # Resume with background writes: checkpoint-8 and -12 are committed by both ranks' agreement.
    with RankedRun(
        out,
        tmp_path,
        world_size=WORLD_SIZE,
        args=[*toy_args(), *ASYNC],
        attempt=2,
        resume_from="latest",
    ) as resumed:
        codes = resumed.wait(RUN_TIMEOUT)
    assert codes == [0] * WORLD_SIZE, f"resumed run exited {codes}\n{resumed.tails()}"
    for rank in range(WORLD_SIZE):
        assert resumed.steps_begun(rank)[0] == msg.step + 1, resumed.tails()
    for step in range(2 * SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS):
        info = store.inspect(f"checkpoint-{step}")
        assert info.complete and info.manifest is not None, info
        assert {f["path"] for f in info.manifest["files"]} >= {
            f"rng_state_{r}.safetensors" for r in range(WORLD_SIZE)
        }
    same, detail = weights_identical(out / f"checkpoint-{MAX_STEPS}", reference.final_checkpoint)
    assert same, f"resumed run differs from the uninterrupted one: {detail}"
