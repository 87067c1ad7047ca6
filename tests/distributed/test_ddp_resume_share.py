"""Issue 38, two gloo ranks of our Trainer (torch.multiprocessing): the resume of a rank-shared
(DDP) checkpoint reads each byte of the shards once over the ranks. Each rank reads about its
share (<= 1.1 x total / N plus the small files: JSONs, its RNG state), counted by the storage
seam (read_stats), and the resumed model and optimizer are bit-identical to the saved ones."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(300)]

WORLD = 2
# JSON files, indexes, the rank's RNG state, manifest: what every rank reads besides its share
SMALL_FILES = 256 << 10


class _Wide(nn.Module):
    """Big enough (about 3.3 MB of weights and Adam state) that the small files do not matter."""

    def __init__(self) -> None:
        super().__init__()
        from trainer_runtime.toy import CLASSES, FEATURES

        # many tensors of one size: the ranks' shares are even (the plan splits by tensors)
        hidden = [nn.Linear(128, 128) for _ in range(16)]
        self.net = nn.Sequential(nn.Linear(FEATURES, 128), *hidden, nn.Linear(128, CLASSES))

    def forward(
        self, x: torch.Tensor, labels: torch.Tensor | None = None, index: Any = None
    ) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _trainer(out: str, seed: int) -> Any:
    from trainer_runtime.toy import ToyDataset
    from trainer_runtime.trainer import Trainer
    from trainer_runtime.training_args import TrainingArguments

    torch.manual_seed(seed)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=2,
        save_strategy="no",
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    return Trainer(model=_Wide(), args=args, train_dataset=ToyDataset(16, seed=3))


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
    from trainer_runtime.checkpoint import read_stats

    saved = _trainer(out, seed=0)
    saved.train()
    saved.save_checkpoint()
    # another initialisation: every value must come from the checkpoint
    resumed = _trainer(out, seed=1)
    read_stats.reset()
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    read = read_stats.bytes_read()
    same_model = all(
        torch.equal(a, b)
        for a, b in zip(
            saved.model.state_dict().values(), resumed.model.state_dict().values(), strict=True
        )
    )
    a, b = saved.optimizer.state_dict(), resumed.optimizer.state_dict()
    same_optimizer = a["param_groups"] == b["param_groups"] and all(
        torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i]
    )
    files = (resumed.last_checkpoint.manifest or {}).get("files", [])
    shards = [f["size"] for f in files if f["path"].startswith(("model-", "optimizer-"))]
    results[rank] = (
        read,
        same_model,
        same_optimizer and set(a["state"]) == set(b["state"]),
        len(shards),
        sum(shards),
    )


def _load_worker(rank: int, port: int, world: int, ckpt: str, results: Any) -> None:
    """``world`` ranks load the shares of a checkpoint saved by another number of ranks."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from trainer_runtime.checkpoint import read_stats
    from trainer_runtime.checkpoint.hf_format import load_model_files
    from trainer_runtime.checkpoint.io import CheckpointReader
    from trainer_runtime.checkpoint.share_resume import load_shared

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        reader = CheckpointReader(ckpt)
        torch.manual_seed(rank + 7)
        model = _Wide()
        read_stats.reset()
        shared = load_shared(reader, model, (reader.info.manifest or {}).get("world_size"))
        read = read_stats.bytes_read()
        assert shared is not None and shared.model_loaded and shared.optimizer is not None
        # the reference: every file read whole by this rank alone (the pre-issue-38 way)
        reference = _Wide()
        load_model_files(
            reference, reader.load_bytes, reader.has, ckpt, load=reader.load_tensors_and_metadata
        )
        expected = reader.load_optimizer()
        reader.wait_verified()
        assert expected is not None
        same_model = all(
            torch.equal(a, b)
            for a, b in zip(
                reference.state_dict().values(), model.state_dict().values(), strict=True
            )
        )
        got = shared.optimizer
        same_optimizer = (
            got["param_groups"] == expected["param_groups"]
            and set(got["state"]) == set(expected["state"])
            and all(
                torch.equal(got["state"][i][k], v)
                for i, state in expected["state"].items()
                for k, v in state.items()
            )
        )
        results[rank] = (read, same_model, same_optimizer)
    finally:
        dist.destroy_process_group()


def run_and_check_shares(out: str) -> None:
    """Two ranks save to ``out`` (a directory or an s3:// URL) and resume from it: each reads
    at most its share (1.1 x total / N) plus the small files, and resumes bit-identical."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_port(), out, results), nprocs=WORLD)
        got = dict(results)
    assert sorted(got) == list(range(WORLD)), got
    for rank, (read, same_model, same_optimizer, shards, total) in sorted(got.items()):
        assert shards == 2 * WORLD, f"rank {rank}: {shards} shard files"
        assert same_model and same_optimizer, f"rank {rank}: not bit-identical"
        limit = 1.1 * total / WORLD + SMALL_FILES
        assert read <= limit, (
            f"rank {rank} read {read} bytes to resume, more than 1.1 x {total} / {WORLD} + "
            f"{SMALL_FILES} = {limit:.0f}"
        )


def test_each_rank_reads_its_share_and_resumes_bit_identical(tmp_path: Path) -> None:
    run_and_check_shares(str(tmp_path / "out"))


def test_another_world_size_reads_whole_files_split_by_bytes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(_port(), str(out), results), nprocs=WORLD)
    ckpt = out / "checkpoint-2"
    shards = [p for p in ckpt.iterdir() if p.name.startswith(("model-", "optimizer-"))]
    total = sum(p.stat().st_size for p in shards)
    largest = max(p.stat().st_size for p in shards)
    world = 3
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_load_worker, args=(_port(), world, str(ckpt), results), nprocs=world)
        got = dict(results)
    assert sorted(got) == list(range(world)), got
    reads = [got[r][0] for r in range(world)]
    # every shard is read by one rank; the index JSONs by all
    assert total <= sum(reads) <= total + world * SMALL_FILES, reads
    for rank, (read, same_model, same_optimizer) in sorted(got.items()):
        assert same_model and same_optimizer, f"rank {rank}: not bit-identical"
        assert read <= total / world + largest + SMALL_FILES, (rank, reads, total)
