"""Resumable batch samplers: an epoch's batch order is a pure function of (seed, epoch).

Resuming at batch ``k`` of an epoch therefore costs nothing: recompute the epoch's order and start
at ``k``; no batch is loaded or collated to be skipped. Subclasses only say how an epoch's global
index order looks (``epoch_indices``) or, for grouping samplers, how the batches look
(``epoch_batches``); sharding over ranks, batching and resume live in the base class.
"""

from __future__ import annotations

import copy
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

    ``even_batches=False`` (``accelerator_config``) skips the wrap-around: no sample is seen twice
    in an epoch, and a rank short of samples ends its epoch with *padding* batches (one real index,
    which the Trainer runs with zero loss weight) so every rank still yields ``len(self)`` batches.
    ``num_real_batches(epoch)`` says where this rank's padding starts.
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
        even_batches: bool = True,
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
        # May be changed before the first epoch is planned (the Trainer sets it from
        # accelerator_config); the plan of an epoch depends on it.
        self.even_batches = even_batches
        self.epoch = 0
        self.start = 0
        self._real_batches: tuple[tuple[int, int, bool], int] | None = None

    # -- what subclasses define --------------------------------------------------------------------
    def epoch_indices(self, epoch: int) -> list[int]:
        """Global index order of ``epoch`` (all ranks); must depend only on (seed, epoch)."""
        raise NotImplementedError

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """This rank's real batches of ``epoch`` (without the padding of ``even_batches=False``)."""
        indices = self.epoch_indices(epoch)
        if self.num_replicas > 1:
            if self.even_batches:
                total = math.ceil(len(indices) / self.num_replicas) * self.num_replicas
                indices = (indices * math.ceil(total / len(indices)))[:total]
            indices = indices[self.rank :: self.num_replicas]
        batches = [
            indices[i : i + self.batch_size] for i in range(0, len(indices), self.batch_size)
        ]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches

    def num_real_batches(self, epoch: int) -> int:
        """Batches of ``epoch`` that carry samples; the ones after it (to ``len(self)``) pad."""
        key = (epoch, self.rank, self.even_batches)
        cached = self._real_batches
        if cached is None or cached[0] != key:
            # Asked once per micro-batch: plan the epoch once.
            cached = (key, min(len(self.epoch_batches(epoch)), len(self)))
            self._real_batches = cached
        return cached[1]

    def is_padding(self, epoch: int, batch: int) -> bool:
        """Batch ``batch`` of ``epoch`` is a padding batch (only with ``even_batches=False``)."""
        return not self.even_batches and batch >= self.num_real_batches(epoch)

    def padded_epoch_batches(self, epoch: int) -> list[list[int]]:
        """Exactly ``len(self)`` batches: the real ones, then padding batches of one index.

        The padding index is the first of this rank's last real batch (a sample like the ones the
        rank just ran; index 0 when the rank has none), so a padding step costs about what a
        real one does and never fails on a missing index.
        """
        if self.even_batches:
            return self.epoch_batches(epoch)
        batches = self.epoch_batches(epoch)[: len(self)]
        pad = [batches[-1][0]] if batches and batches[-1] else [0]
        return batches + [list(pad) for _ in range(len(self) - len(batches))]

    def for_rank(self, rank: int) -> ResumableBatchSampler:
        """A copy of this sampler (same epoch and position) that plans for ``rank``: the main
        process uses it to build every rank's batch when it dispatches batches."""
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank={rank!r} must be within [0, num_replicas={self.num_replicas})")
        other = copy.copy(self)
        other.rank = rank
        return other

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
        yield from self.padded_epoch_batches(self.epoch)[self.start :]

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
    even_batches: bool = True,
) -> ResumableBatchSampler:
    """The batch sampler registered for ``strategy`` in :data:`BATCH_SAMPLERS`."""
    factory = BATCH_SAMPLERS.get(strategy)
    if factory is None:
        raise ValueError(
            f"train_sampling_strategy={strategy!r} is not known; "
            f"use one of {sorted(BATCH_SAMPLERS)}"
        )
    sampler = factory(
        dataset, batch_size, seed=seed, drop_last=drop_last, num_replicas=num_replicas, rank=rank
    )
    sampler.even_batches = even_batches
    return sampler
