"""Issue 37, two gloo ranks of our Trainer (torch.multiprocessing): a rank-shared (DDP) save where
one rank holds a tensor the other does not fails on both ranks with a message naming it, before
anything is committed: the directory keeps its sentinel (incomplete), no index points at a shard
without the tensor, and "latest" finds no complete checkpoint to resume from."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from trainer_runtime.checkpoint.layout import MANIFEST_NAME, SENTINEL_NAME, CheckpointStore

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]

WORLD = 2
EXTRA = "only_on_rank_1"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, out: str, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD),
        OMP_NUM_THREADS="1",
    )
    for name in ("PREEMPTIBLE_OUTPUT_DIR", "PREEMPTIBLE_ATTEMPT", "PREEMPTIBLE_RESUME_FROM"):
        os.environ.pop(name, None)
    torch.set_num_threads(1)
    from trainer_runtime.toy import ToyDataset, ToyModel
    from trainer_runtime.trainer import Trainer
    from trainer_runtime.training_args import TrainingArguments

    torch.manual_seed(0)
    model = ToyModel(dropout=0.0)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=1,
        save_strategy="no",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=ToyDataset(16, seed=3))
    trainer.train()
    if rank == 1:
        # a tensor one rank has and the other has not (e.g. state created on one rank only)
        model.register_buffer(EXTRA, torch.ones(3))
    try:
        trainer.save_checkpoint()
    except Exception as exc:
        results[rank] = f"{type(exc).__name__}: {exc}"
    else:
        results[rank] = None


def test_ranks_that_disagree_on_the_tensors_commit_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_port(), str(out), results), nprocs=WORLD)
        errors = dict(results)
    assert set(errors) == {0, 1}, errors
    for rank, error in errors.items():
        assert error is not None, f"rank {rank}: the save was committed"
        assert error.startswith("CheckpointError"), error
        assert f"model tensor '{EXTRA}' is on rank(s) 1 only (not on 0)" in error, error
    ckpt = out / "checkpoint-1"
    assert (ckpt / SENTINEL_NAME).exists() and not (ckpt / MANIFEST_NAME).exists()
    assert not list(ckpt.glob("*.index.json")) and not list(ckpt.glob("model-*"))
    store = CheckpointStore(str(out))
    assert store.latest_complete() is None, store.list()
