"""SIGKILL of one rank while a multi-rank checkpoint is being written: that checkpoint never gets a
manifest, reads as incomplete, and the resumed run uses the previous complete one."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import (
    MAX_STEPS,
    RUN_TIMEOUT,
    SAVE_STEPS,
    WORLD_SIZE,
    Reference,
    resume_to_end,
    toy_args,
)
from tests.distributed.ranks import RankedRun
from trainer_runtime.checkpoint.layout import MANIFEST_NAME, CheckpointStore
from trainer_runtime.testing import weights_identical

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

# After a peer dies, gloo fails the survivors' next collective at once (connection reset); the
# operator would tear the attempt down anyway, so give them a bounded time, then SIGKILL them.
SURVIVOR_TIMEOUT = 90.0


@pytest.mark.parametrize("victim", [1, 0], ids=["non-coordinator", "coordinator"])
def test_sigkill_one_rank_during_save(tmp_path: Path, reference: Reference, victim: int) -> None:
    out = tmp_path / "out"
    doomed = 2 * SAVE_STEPS
    # Every checkpoint file takes 0.3 s to write, so the save of step 8 lasts seconds.
    with RankedRun(out, tmp_path, world_size=WORLD_SIZE, args=toy_args(save_sleep=0.3)) as run:
        # save_begin: the coordinator created the sentinel of checkpoint-8.
        run.ranks[0].wait_for_event("save_begin", step=doomed, timeout=RUN_TIMEOUT)
        time.sleep(0.5)  # into the file writes (not synchronisation: any moment of the save works)
        run.send(victim, signal.SIGKILL)
        deadline = time.monotonic() + SURVIVOR_TIMEOUT
        codes = {}
        for rank, proc_run in enumerate(run.ranks):
            assert proc_run.proc is not None
            try:
                codes[rank] = proc_run.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:
                proc_run.kill()
                codes[rank] = None
    assert codes[victim] == -signal.SIGKILL, codes
    assert all(c != 0 for c in codes.values()), f"no rank may report success: {codes}"

    store = CheckpointStore(str(out))
    info = store.inspect(f"checkpoint-{doomed}")
    assert not info.complete, info
    assert not (out / f"checkpoint-{doomed}" / MANIFEST_NAME).exists()
    assert info.reason, info
    assert [c.step for c in store.incomplete()] == [doomed]
    latest = store.latest_complete()
    assert latest is not None and latest.step == SAVE_STEPS, latest

    if victim == 0:
        return  # resuming from the previous checkpoint is the same path as below; save the time
    resume_to_end(out, tmp_path, attempt=2, first_step=SAVE_STEPS + 1)
    final = CheckpointStore(str(out)).inspect(f"checkpoint-{MAX_STEPS}")
    assert final.complete, final.reason
    same, detail = weights_identical(out / f"checkpoint-{MAX_STEPS}", reference.final_checkpoint)
    assert same, f"resumed run differs from the uninterrupted one: {detail}"
