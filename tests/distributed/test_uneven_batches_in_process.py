"""Two gloo ranks in one test process (torch.multiprocessing): the loss stays exact when a rank
only pads (even_batches=False), and an iterable dataset is dispatched by default (one stream
split over the ranks, no sample twice, resumable bit for bit)."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.data import IterableDataset

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

WORLD = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _join_group(rank: int, port: int) -> None:
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
        os.environ.pop(name, None)  # library mode: a JIT stop returns instead of exiting
    torch.set_num_threads(1)


def _args(out: Path, **overrides: Any) -> Any:
    from trainer_runtime.training_args import TrainingArguments

    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 2,
        "learning_rate": 0.5,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "logging_steps": 1,
        "save_steps": 100,
        "use_cpu": True,
        "report_to": "none",
        "disable_tqdm": True,
    }
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _exact_loss_worker(rank: int, port: int, out: str, results: Any) -> None:
    _join_group(rank, port)
    from trainer_runtime.toy import ToyDataset, ToyModel
    from trainer_runtime.trainer import Trainer

    data = ToyDataset(5, seed=3)
    torch.manual_seed(0)
    model = ToyModel(dropout=0.0)
    initial = copy.deepcopy(model.state_dict())
    # Sequential, 2 per rank: step 1 = rank 0 [0, 2] + rank 1 [1, 3]; step 2 = rank 0 [4] and
    # rank 1 a padding batch (zero loss, zero gradient, zero label tokens).
    args = _args(
        Path(out),
        max_steps=2,
        train_sampling_strategy="sequential",
        accelerator_config={"even_batches": False},
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()

    reference = ToyModel(dropout=0.0)
    reference.load_state_dict(initial)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for indices in ([0, 1, 2, 3], [4]):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            reference.net(data.x[indices]), data.labels[indices]
        )
        loss.backward()
        optimizer.step()
    trained, expected = trainer.model.state_dict(), reference.state_dict()
    results[rank] = max(float((trained[k] - expected[k]).abs().max()) for k in expected)


def test_padding_rank_keeps_the_loss_exact(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_exact_loss_worker, args=(_port(), str(tmp_path), results), nprocs=WORLD)
        diffs = dict(results)
    # Same math as one process over the global batches, up to float summation order.
    assert set(diffs) == {0, 1} and max(diffs.values()) < 1e-6, diffs


class _Stream(IterableDataset):  # type: ignore[type-arg]
    """The toy samples 0..n-1 in order, every epoch: one stream only the main process reads."""

    def __init__(self, n: int) -> None:
        from trainer_runtime.toy import ToyDataset

        self.data = ToyDataset(n, seed=4, with_index=True)

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(len(self.data)))


def _iterable_worker(rank: int, port: int, out: str, results: Any) -> None:
    _join_group(rank, port)
    from trainer_runtime.callbacks import TrainerCallback
    from trainer_runtime.signals import SigtermLatch
    from trainer_runtime.toy import ToyModel
    from trainer_runtime.trainer import Trainer

    def build(name: str, seen: list[tuple[int, list[int], bool]], **overrides: Any) -> Trainer:
        torch.manual_seed(0)
        model = ToyModel(dropout=0.1)
        args = _args(
            Path(out) / name,
            max_steps=5,
            per_device_train_batch_size=4,
            accelerator_config={"even_batches": False},  # dispatch_batches: None
            **overrides,
        )
        trainer = Trainer(model=model, args=args, train_dataset=_Stream(21))

        def hook(module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            if module.training:
                indices = [int(i) for i in kwargs["index"].tolist()]
                seen.append((trainer.state.global_step + 1, indices, trainer.in_padding_batch))

        model.register_forward_pre_hook(hook, with_kwargs=True)
        return trainer

    full_seen: list[tuple[int, list[int], bool]] = []
    full = build("full", full_seen)
    full.train()

    stopped_seen: list[tuple[int, list[int], bool]] = []
    jit = build("run", stopped_seen, enable_jit_checkpoint=True)
    jit.sigterm_latch = SigtermLatch(kill_wait=0.0)

    class SigtermOnRank1(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if rank == 1 and state.global_step == 2:
                jit.sigterm_latch.trigger()  # type: ignore[union-attr]

    jit.add_callback(SigtermOnRank1())
    jit.train()
    resumed_seen: list[tuple[int, list[int], bool]] = []
    resumed = build("run", resumed_seen)
    resumed.train(resume_from_checkpoint=True)
    a, b = full.model.state_dict(), resumed.model.state_dict()
    results[rank] = {
        "full": full_seen,
        "stopped_at": jit.state.global_step,
        "resumed": [*[s for s in stopped_seen if s[0] <= jit.state.global_step], *resumed_seen],
        "identical": all(torch.equal(a[k], b[k]) for k in a),
    }


def test_iterable_dataset_is_dispatched_once_per_sample_and_resumes(tmp_path: Path) -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_iterable_worker, args=(_port(), str(tmp_path), results), nprocs=WORLD)
        got = {rank: dict(value) for rank, value in results.items()}
    assert set(got) == {0, 1}
    # 21 samples in global batches of 8: steps 1-3 are epoch 0 (8, 8, 5: rank 0 gets 4, rank 1
    # gets 1), steps 4-5 start epoch 1.
    epoch0 = [
        i
        for rank in (0, 1)
        for step, indices, pad in got[rank]["full"]
        if step <= 3 and not pad
        for i in indices
    ]
    assert sorted(epoch0) == list(range(21)), epoch0
    last = {rank: [i for s, i, _ in got[rank]["full"] if s == 3] for rank in (0, 1)}
    assert last == {0: [[16, 17, 18, 19]], 1: [[20]]}
    # Step 1 of the second epoch starts the stream over.
    assert [i for s, i, _ in got[0]["full"] if s == 4] == [[0, 1, 2, 3]]
    for rank in (0, 1):
        assert got[rank]["stopped_at"] == 2
        assert got[rank]["identical"], f"rank {rank}: resumed weights differ"
        assert got[rank]["resumed"] == got[rank]["full"]
