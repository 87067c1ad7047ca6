"""Resumable batch samplers: an epoch's batch order is a pure function of (seed, epoch).

Resuming at batch ``k`` of an epoch therefore costs nothing: recompute the epoch's order and start
at ``k``; no batch is loaded or collated to be skipped. Subclasses only say how an epoch's global
index order looks (``epoch_indices``) or, for grouping samplers, how the batches look
(``epoch_batches``); sharding over ranks, batching and resume live in the base class.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = [
    "BATCH_SAMPLERS",
    "RandomBatchSampler",
    "ResumableBatchSampler",
    "SequentialBatchSampler",
    "build_batch_sampler",
]


class ResumableBatchSampler(Sampler[list[int]]):
    """Yields lists of dataset indices for this rank, starting at batch ``start`` of ``epoch``.

    With several ranks the epoch's index order is padded (by wrapping around) to a multiple of
    ``num_replicas`` and rank ``r`` takes every ``num_replicas``-th index from position ``r``, so
    every rank gets the same number of batches (a rank with fewer batches would hang a collective).
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples!r}: the dataset is empty")
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size!r} must be >= 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank!r} must be within [0, num_replicas={num_replicas})")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.start = 0

    # -- what subclasses define --------------------------------------------------------------------
    def epoch_indices(self, epoch: int) -> list[int]:
        """Global index order of ``epoch`` (all ranks); must depend only on (seed, epoch)."""
        raise NotImplementedError

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of ``epoch``."""
        indices = self.epoch_indices(epoch)
        if self.num_replicas > 1:
            total = math.ceil(len(indices) / self.num_replicas) * self.num_replicas
            indices = (indices * math.ceil(total / len(indices)))[:total]
            indices = indices[self.rank :: self.num_replicas]
        batches = [
            indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)
        ]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    # -- resume ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first batch."""
        self.epoch = int(epoch)
        self.start = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Position the sampler at batch ``state["start"]`` of epoch ``state["epoch"]``."""
        epoch, start = int(state.get("epoch", 0)), int(state.get("start", 0))
        if start < 0:
            raise ValueError(f"sampler start={start!r} must be >= 0")
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.epoch_batches(self.epoch)[self.start :]

    def __len__(self) -> int:
        """Number of batches in a whole epoch for this rank (not what is left of it)."""
        per_rank = math.ceil(self.num_samples / self.num_replicas)
        if self.drop_last:
            return per_rank // self.batch_size
        return math.ceil(per_rank / self.batch_size)


class SequentialBatchSampler(ResumableBatchSampler):
    """Indices in dataset order, every epoch."""

    def epoch_indices(self, epoch: int) -> list[int]:
        return list(range(self.num_samples))


class RandomBatchSampler(ResumableBatchSampler):
    """A fresh permutation per epoch, drawn from its own generator seeded with seed + epoch.

    It never touches the global torch RNG, so restoring the global RNG and the sampler position
    are independent.
    """

    def epoch_indices(self, epoch: int) -> list[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()


SamplerFactory = Callable[..., ResumableBatchSampler]

# train_sampling_strategy -> factory(dataset, batch_size, *, seed, drop_last, num_replicas, rank).
# Other samplers (length grouping) register here.
BATCH_SAMPLERS: dict[str, SamplerFactory] = {
    "random": lambda dataset, batch_size, **kw: RandomBatchSampler(len(dataset), batch_size, **kw),
    "sequential": lambda dataset, batch_size, **kw: SequentialBatchSampler(
        len(dataset), batch_size, **kw
    ),
}


def build_batch_sampler(
    strategy: str,
    dataset: Sized,
    batch_size: int,
    *,
    seed: int,
    drop_last: bool = False,
    num_replicas: int = 1,
    rank: int = 0,
) -> ResumableBatchSampler:
    """The batch sampler registered for ``strategy`` in :data:`BATCH_SAMPLERS`."""
    factory = BATCH_SAMPLERS.get(strategy)
    if factory is None:
        raise ValueError(
            f"train_sampling_strategy={strategy!r} is not known; "
            f"use one of {sorted(BATCH_SAMPLERS)}"
        )
    return factory(
        dataset, batch_size, seed=seed, drop_last=drop_last, num_replicas=num_replicas, rank=rank
    )
