"""Batch dispatch (``accelerator_config.dispatch_batches``) and padding micro-batches.

With dispatch, only the main process iterates a DataLoader; every micro-batch it sends each rank
that rank's share with one ``scatter_object_list``, and the ranks train on what they receive.

* Map-style datasets: the main process's batch sampler (:class:`GlobalBatchSampler`) yields, for
  micro-batch ``k``, batch ``k`` of *every* rank's resumable sampler, tagged with the rank; each
  rank's share is collated on its own (:class:`SplitCollate`). A rank therefore receives exactly
  the tensors it would have loaded itself: the same samples, the same padding, the same resume
  position (the main process's sampler position, which is every rank's).
* Iterable datasets: the main process reads global batches of ``world_size * batch_size`` items
  from the one stream and cuts them into consecutive shares (:class:`SplitStream`). When the
  stream ends, an end marker goes to every rank, so all ranks finish the epoch together.

``even_batches=False`` can leave a rank without samples for a micro-batch; it then gets a
:class:`PaddingBatch` (one real sample) which the Trainer runs with zero loss weight, so every
rank still takes part in each collective (DDP's all-reduce, the stop agreement).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from trainer_runtime.data.samplers import ResumableBatchSampler

__all__ = [
    "GlobalBatchSampler",
    "PaddingBatch",
    "SplitCollate",
    "SplitStream",
    "TaggedDataset",
    "dispatch_iterator",
    "split_counts",
]


class PaddingBatch(dict):  # type: ignore[type-arg]
    """A micro-batch that only keeps a rank in step: trained with zero loss weight, its samples
    are not counted (tokens, label items) and it is not a sample "seen" in the epoch."""


def as_padding(batch: Any) -> PaddingBatch:
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"a batch must be a mapping of model inputs, got {type(batch).__name__}; "
            "return dicts from the dataset or the data_collator"
        )
    return PaddingBatch(batch)


class TaggedDataset(Dataset):  # type: ignore[type-arg]
    """``dataset`` indexed by ``(rank, index, padding)``: yields ``(rank, padding, item)``."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int, bool]) -> tuple[int, bool, Any]:
        rank, index, padding = key
        return rank, padding, self.dataset[index]


class GlobalBatchSampler(Sampler[list[tuple[int, int, bool]]]):
    """Micro-batch ``k`` of every rank, from ``sampler``'s position (its epoch and start).

    ``sampler`` is the main process's own resumable sampler: the Trainer positions it
    (``load_state_dict``) as without dispatch, and the other ranks' plans are derived from it with
    ``for_rank``, so the global sample set of every step is the one a non-dispatch run uses.
    """

    def __init__(self, sampler: ResumableBatchSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[tuple[int, int, bool]]]:
        s = self.sampler
        views = [s.for_rank(r) for r in range(s.num_replicas)]
        plans = [v.padded_epoch_batches(s.epoch) for v in views]
        real = [v.num_real_batches(s.epoch) for v in views]
        for k in range(s.start, min(len(p) for p in plans)):
            yield [
                (r, index, not s.even_batches and k >= real[r])
                for r, plan in enumerate(plans)
                for index in plan[k]
            ]


class SplitCollate:
    """Collate each rank's share of a tagged global batch separately: a list, one per rank."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], world_size: int) -> None:
        self.collate_fn = collate_fn
        self.world_size = world_size

    def __call__(self, items: Sequence[tuple[int, bool, Any]]) -> list[Any]:
        shares: list[list[Any]] = [[] for _ in range(self.world_size)]
        padding = [False] * self.world_size
        for rank, pad, item in items:
            shares[rank].append(item)
            padding[rank] = padding[rank] or pad
        out = []
        for rank, share in enumerate(shares):
            batch = self.collate_fn(share)
            out.append(as_padding(batch) if padding[rank] else batch)
        return out


def split_counts(total: int, batch_size: int, world_size: int) -> list[int]:
    """Items of a global batch of ``total`` items that each rank gets: ``batch_size`` each in
    order, so only the epoch's last (short) batch leaves the last ranks with fewer or none."""
    return [max(0, min(batch_size, total - r * batch_size)) for r in range(world_size)]


class SplitStream:
    """Cut a global batch read from an iterable dataset into per-rank shares and collate them.

    ``even_batches=True``: a short last batch is filled by wrapping around its own items, so every
    rank gets ``batch_size`` samples (some twice); False: the last ranks get fewer, and a rank with
    none gets a :class:`PaddingBatch` of the batch's first item.
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any],
        world_size: int,
        batch_size: int,
        *,
        even_batches: bool,
    ) -> None:
        self.collate_fn = collate_fn
        self.world_size = world_size
        self.batch_size = batch_size
        self.even_batches = even_batches

    def __call__(self, items: Sequence[Any]) -> list[Any]:
        items = list(items)
        full = self.batch_size * self.world_size
        if self.even_batches and 0 < len(items) < full:
            items = (items * -(-full // len(items)))[:full]
        out: list[Any] = []
        start = 0
        for count in split_counts(len(items), self.batch_size, self.world_size):
            if count == 0:
                out.append(as_padding(self.collate_fn(items[:1])))
                continue
            out.append(self.collate_fn(items[start : start + count]))
            start += count
        return out


class _EndOfData:
    """Sent to every rank when the main process's data ends (iterable datasets)."""


class _DataFailed:
    def __init__(self, message: str) -> None:
        self.message = message


def _scatter(shares: list[Any] | None, rank: int) -> Any:
    out: list[Any] = [None]
    dist.scatter_object_list(out, shares if rank == 0 else None, src=0)
    return out[0]


def dispatch_iterator(source: Iterator[list[Any]] | None, *, rank: int) -> Iterator[Any]:
    """This rank's micro-batches: rank 0 reads ``source`` (lists of per-rank shares) and scatters;
    the other ranks pass ``source=None`` and receive. Every ``next`` is one collective, so all
    ranks must call it equally often (the Trainer's step plan guarantees it)."""
    while True:
        shares: list[Any] | None = None
        failure: BaseException | None = None
        if rank == 0:
            assert source is not None
            try:
                shares = next(source)
            except StopIteration:
                shares = None
            except Exception as exc:  # the other ranks must not wait for data forever
                failure = exc
            world = dist.get_world_size()
            if failure is not None:
                shares = [_DataFailed(f"{type(failure).__name__}: {failure}")] * world
            elif shares is None:
                shares = [_EndOfData()] * world
        share = _scatter(shares, rank)
        if failure is not None:
            raise failure
        if isinstance(share, _DataFailed):
            raise RuntimeError(f"the main process failed to load a batch: {share.message}")
        if isinstance(share, _EndOfData):
            return
        yield share
