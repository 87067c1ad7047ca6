"""Two gloo ranks resume from a checkpoint only one of them finds corrupt (its own RNG file):
both fall back to the previous complete checkpoint together (issue 31, item 3)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def _worker(rank: int, port: int, out: str, results: dict) -> None:  # type: ignore[type-arg]
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    for name in ("PREEMPTIBLE_OUTPUT_DIR", "PREEMPTIBLE_ATTEMPT", "PREEMPTIBLE_RESUME_FROM"):
        os.environ.pop(name, None)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from tests.unit.runtime.test_resume import make_trainer
    from tests.unit.runtime.test_resume_fallback import StartStep, flip_byte

    root = Path(out)
    full = make_trainer(root / "full", max_steps=6, save_steps=100)
    full.train()
    make_trainer(root / "run", max_steps=6, save_steps=2).train()  # checkpoints 2, 4, 6
    dist.barrier()
    if rank == 0:
        # only rank 1 reads this file: rank 0's own load of checkpoint-6 succeeds
        flip_byte(root / "run" / "checkpoint-6" / "rng_state_1.safetensors")
    dist.barrier()
    resumed = make_trainer(root / "run", max_steps=6, save_steps=100)
    start = StartStep()
    resumed.add_callback(start)
    resumed.train(resume_from_checkpoint=True)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    results[rank] = (start.step, all(torch.equal(a[k], b[k]) for k in a), start.marker)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_agree_to_fall_back_when_one_finds_the_checkpoint_corrupt(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, str(tmp_path), results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        step, identical, marker = results[rank]
        # both resumed from checkpoint-4 and ended where an uninterrupted run ends
        assert (step, identical) == (4, True), results
        # rank 0 wrote the marker (before training went on) with rank 1's finding
        assert marker is not None and "rank 1" in marker["reason"], marker
        assert "rng_state_1.safetensors" in marker["reason"], marker
