"""Rank agreement helpers: no-ops in one process, a real all-reduce with two gloo ranks."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer_runtime.distributed import collectives


def test_single_process_is_noop() -> None:
    assert not collectives.is_distributed()
    assert collectives.agree_to_stop(True) is True
    assert collectives.agree_to_stop(False) is False
    assert collectives.all_reduce_sum(7) == 7
    assert collectives.rank() == 0 and collectives.world_size() == 1
    collectives.barrier()


def _worker(rank: int, port: int, results: dict) -> None:  # type: ignore[type-arg]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        # only rank 1 saw SIGTERM
        results[rank] = (
            collectives.agree_to_stop(rank == 1),
            collectives.agree_to_stop(False),
            collectives.all_reduce_sum(rank + 1),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_ranks_agree() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, results), nprocs=2, join=True)
        assert dict(results) == {0: (True, False, 3), 1: (True, False, 3)}


def _trainer_worker(rank: int, port: int, out: str, results: dict) -> None:  # type: ignore[type-arg]
    """One rank of a 2-rank CPU (gloo) run: full run, JIT stop seen by rank 1 only, resume."""
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
        os.environ.pop(name, None)  # library mode: a JIT stop returns instead of exiting
    import torch

    torch.set_num_threads(1)
    from pathlib import Path

    from tests.unit.runtime.test_resume import make_trainer
    from trainer_runtime.callbacks import TrainerCallback
    from trainer_runtime.signals import SigtermLatch

    def params(trainer) -> dict:  # type: ignore[no-untyped-def,type-arg]
        return {k: v.clone() for k, v in trainer.model.state_dict().items()}

    full = make_trainer(Path(out) / "full", max_steps=6, save_steps=100)
    full.train()
    assert collectives.is_distributed()

    jit = make_trainer(Path(out) / "run", max_steps=6, save_steps=100, enable_jit_checkpoint=True)
    jit.sigterm_latch = SigtermLatch(kill_wait=0.0)

    class SigtermOnRank1(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if rank == 1 and state.global_step == 2:
                jit.sigterm_latch.trigger()  # type: ignore[union-attr]

    jit.add_callback(SigtermOnRank1())
    jit.train()
    stopped_at = jit.state.global_step

    resumed = make_trainer(Path(out) / "run", max_steps=6, save_steps=100)
    resumed.train(resume_from_checkpoint=True)
    a, b = params(full), params(resumed)
    results[rank] = (
        stopped_at,
        jit.preempted,
        all(torch.equal(a[k], b[k]) for k in a),
        sorted(p.name for p in (Path(out) / "run" / "checkpoint-2").iterdir()),
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_training_jit_stop_and_bit_identical_resume(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_trainer_worker, args=(port, str(tmp_path), results), nprocs=2, join=True)
        results = dict(results)
    # the replicated model and optimizer state is shared by the two ranks (shares.py)
    files = [
        "manifest.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "optimizer-00001-of-00002.safetensors",
        "optimizer-00002-of-00002.safetensors",
        "optimizer.safetensors.index.json",
        "preemptible_state.json",
        "rng_state_0.safetensors",
        "rng_state_1.safetensors",
        "scheduler.json",
        "trainer_state.json",
        "training_args.json",
    ]
    # only rank 1 saw the signal; both ranks stopped after step 2 and wrote one checkpoint
    assert results == {0: (2, True, True, files), 1: (2, True, True, files)}
