"""Two gloo ranks resume from a corrupt checkpoint and fall back to the previous complete one
together: when only one of them finds the damage (its own RNG file, or a shard of the shared model
that only it reads back: issue 38) (issue 31, item 3)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def _worker(rank: int, port: int, out: str, damage: tuple, results: dict) -> None:  # type: ignore[type-arg]
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
        name, offset = damage
        flip_byte(root / "run" / "checkpoint-6" / name, offset)
    dist.barrier()
    resumed = make_trainer(root / "run", max_steps=6, save_steps=100)
    start = StartStep()
    resumed.add_callback(start)
    resumed.train(resume_from_checkpoint=True)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    results[rank] = (start.step, all(torch.equal(a[k], b[k]) for k in a), start.marker)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("damage", "finding"),
    [
        # only rank 1 reads its RNG file: rank 0's own load succeeds, rank 1's checksum fails
        pytest.param(("rng_state_1.safetensors", -3), "rank 1: ", id="one-rank-checksum"),
        # a model shard's broken header: only its reading rank (rank 1, which wrote it) reads it
        # and checks it whole before parsing (issue 38): its checksum finds the damage, and rank
        # 0, whose share is fine, falls back with it
        pytest.param(
            ("model-00002-of-00002.safetensors", 9), "rank 1: ", id="share-reader-checksum"
        ),
    ],
)
def test_ranks_agree_to_fall_back_from_a_corrupt_checkpoint(
    tmp_path: Path, damage: tuple[str, int], finding: str
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, str(tmp_path), damage, results), nprocs=2, join=True)
        results = dict(results)
    for rank in (0, 1):
        step, identical, marker = results[rank]
        # both resumed from checkpoint-4 and ended where an uninterrupted run ends
        assert (step, identical) == (4, True), results
        # rank 0 wrote the marker (before training went on), naming the damaged file
        assert marker is not None and damage[0] in marker["reason"], marker
        assert finding in marker["reason"], marker
