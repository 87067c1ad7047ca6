"""Length-aware batch samplers: ``group_by_length`` and ``batch_rebalance``.

Both are *batch* samplers (they yield lists of dataset indices, one list per micro-batch of this
rank) whose whole epoch plan is a pure function of ``(seed, epoch, lengths, rank, ...)``.
Resuming therefore never touches the data: ``load_state_dict`` sets the epoch and the number of
micro-batches already consumed, and the next ``__iter__`` starts at exactly the following batch.

They follow the protocol of :class:`trainer_runtime.data.samplers.ResumableBatchSampler`
(``set_epoch``, ``state_dict`` = ``{"epoch", "start"}`` plus a fingerprint, ``load_state_dict``,
``__len__``), and shard like it: the epoch's permutation is padded by wrapping around to a multiple
of the world size, so every rank gets the same number of micro-batches, and the ranks' samples are
disjoint apart from that padding. With ``even_batches=False`` there is no wrap-around: the samples
are disjoint, and a rank short of samples ends the epoch with padding batches (see
``ResumableBatchSampler``). Importing this module registers both strategies in
``samplers.BATCH_SAMPLERS``."""

from __future__ import annotations

import base64
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trainer_runtime.data.samplers import BATCH_SAMPLERS, ResumableBatchSampler
from trainer_runtime.errors import ConfigurationError

__all__ = [
    "EPOCH_ORDER_KEY",
    "LENGTH_STRATEGIES",
    "BatchRebalanceBatchSampler",
    "LengthGroupedBatchSampler",
    "balanced_partition",
    "batch_rebalance_plan",
    "build_length_batch_sampler",
    "eval_length_grouped_order",
    "group_by_length_plan",
    "infer_lengths",
    "item_length",
    "padded_cost",
]

logger = logging.getLogger(__name__)

LENGTH_STRATEGIES = ("group_by_length", "batch_rebalance")
# Key of the runtime record (preemptible_state.json) holding what LengthGroupedBatchSampler.
# begin_epoch returned: how a resume rebuilds the epoch's order.
EPOCH_ORDER_KEY = "group_by_length_order"
DEFAULT_MODEL_INPUT_NAME = "input_ids"
# Upper bound of the megabatch multiplier, as in the Hugging Face length-grouped sampler.
_MAX_MEGA_BATCH_MULT = 50


# --------------------------------------------------------------------------------------------
# Lengths
# --------------------------------------------------------------------------------------------


def _is_mapping_like(obj: Any) -> bool:
    # BatchFeature / BatchEncoding are UserDicts (Mappings); accept any keys()+__getitem__ object.
    return isinstance(obj, Mapping) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__"))


def _value_length(value: Any, where: str) -> int:
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, list | tuple):
        if len(shape) == 0:
            raise ConfigurationError(
                f"cannot infer the length of {where}: it is a scalar; add a length column "
                "(length_column_name) or make the first model input a sequence"
            )
        # Processors often return a leading batch dimension of 1 ([1, seq_len]).
        if len(shape) >= 2 and shape[0] == 1:
            return int(shape[1])
        return int(shape[0])
    if isinstance(value, str | bytes) or not hasattr(value, "__len__"):
        raise ConfigurationError(
            f"cannot infer the length of {where}: got {type(value).__name__}; add a length column "
            "(length_column_name) or make the first model input a sequence"
        )
    return len(value)


def item_length(
    item: Any,
    *,
    model_input_name: str | None = None,
    length_column_name: str | None = None,
    index: int | None = None,
) -> int:
    """Length of one dataset item.

    A mapping-like item (dict, ``BatchFeature``...) uses ``length_column_name`` when it holds that
    key, else ``model_input_name`` (default ``input_ids``) when present, else its first value. A
    tuple uses its first element; a tensor, array or list is measured directly.
    """
    where = f"item {index}" if index is not None else "the item"
    if _is_mapping_like(item):
        keys = list(item.keys())
        if length_column_name is not None and length_column_name in keys:
            return int(item[length_column_name])
        name = model_input_name or DEFAULT_MODEL_INPUT_NAME
        if name not in keys:
            if not keys:
                raise ConfigurationError(f"cannot infer the length of {where}: it has no keys")
            name = keys[0]
        return _value_length(item[name], f"{where}[{name!r}]")
    if isinstance(item, tuple):
        if not item:
            raise ConfigurationError(f"cannot infer the length of {where}: empty tuple")
        return _value_length(item[0], f"{where}[0]")
    return _value_length(item, where)


def infer_lengths(
    dataset: Any,
    *,
    length_column_name: str = "length",
    model_input_name: str | None = None,
) -> list[int]:
    """Length of every item of a map-style dataset.

    A ``datasets.Dataset`` with column ``length_column_name`` is read from that column without
    touching the items; otherwise every item is read once (a full scan of the dataset).
    """
    column_names = getattr(dataset, "column_names", None)
    if isinstance(column_names, list | tuple) and length_column_name in column_names:
        return [int(x) for x in dataset[length_column_name]]
    try:
        n = len(dataset)
    except TypeError as exc:
        raise ConfigurationError(
            "length-based sampling needs a dataset with a known length (map-style); "
            f"got {type(dataset).__name__} without __len__"
        ) from exc
    lengths = [
        item_length(
            dataset[i],
            model_input_name=model_input_name,
            length_column_name=length_column_name,
            index=i,
        )
        for i in range(n)
    ]
    return lengths


def padded_cost(lengths: Sequence[int]) -> int:
    """Tokens a micro-batch occupies once padded to its longest sample: ``max * count``."""
    return max(lengths) * len(lengths) if lengths else 0


# --------------------------------------------------------------------------------------------
# Pure planning functions
# --------------------------------------------------------------------------------------------


def _epoch_permutation(
    n: int, seed: int, epoch: int, generator_state: torch.Tensor | None = None
) -> list[int]:
    generator = torch.Generator()
    if generator_state is not None:
        # The global torch RNG's state when the epoch began (group_by_length, one process).
        generator.set_state(generator_state)
    else:
        # Same seeding convention as DistributedSampler: seed + epoch.
        generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).tolist()


def _pad_to_world(perm: list[int], world_size: int) -> list[int]:
    """Pad by wrapping around so the ranks get equally many samples (as the base sampler does)."""
    total = math.ceil(len(perm) / world_size) * world_size
    out = list(perm)
    while len(out) < total:
        out.extend(perm[: total - len(out)])
    return out


def _check_common(lengths: Sequence[int], batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ConfigurationError(
            f"per_device_train_batch_size must be >= 1, got {batch_size}: set a positive batch size"
        )
    if world_size < 1:
        raise ConfigurationError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigurationError(
            f"rank must be in [0, world_size={world_size}), got {rank}: check RANK and WORLD_SIZE"
        )
    if len(lengths) == 0:
        raise ConfigurationError("the training dataset is empty: length-based sampling needs data")
    if any(int(x) < 0 for x in lengths):
        raise ConfigurationError("sample lengths must be >= 0; check the length column")


def group_by_length_plan(
    lengths: Sequence[int],
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    mega_batch_mult: int | None = None,
    even_batches: bool = True,
    gradient_accumulation_steps: int = 1,
    generator_state: torch.Tensor | None = None,
) -> list[list[int]]:
    """This rank's micro-batches for one epoch of ``group_by_length``.

    As transformers' length-grouped sampler (on one process the same order from the same
    permutation): the epoch permutation (drawn from a generator in ``generator_state``, else
    seeded with ``seed + epoch``) is cut into megabatches of ``mega_batch_mult * batch_size *
    gradient_accumulation_steps * world_size`` samples (``mega_batch_mult`` by default the
    largest of 1 and ``min(samples // (4 * that step size), 50)``), each sorted by length
    (longest first, ties in permutation order); the longest sample of the epoch then trades
    places with the first sample of the first megabatch, so an out-of-memory shows up on the
    first step. Consecutive ``batch_size * world_size`` runs of the sorted order are dealt
    round-robin to the ranks, so the ranks of a micro-step get similar lengths.
    ``even_batches=False``: no wrap-around, so the last ranks may get fewer samples (and
    micro-batches).
    """
    _check_common(lengths, batch_size, rank, world_size)
    if gradient_accumulation_steps < 1:
        raise ConfigurationError(
            f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
        )
    perm = _epoch_permutation(len(lengths), seed, epoch, generator_state)
    if even_batches:
        perm = _pad_to_world(perm, world_size)
    step_size = batch_size * gradient_accumulation_steps * world_size
    if mega_batch_mult is None:
        mega_batch_mult = max(1, min(len(perm) // (step_size * 4), _MAX_MEGA_BATCH_MULT))
    if mega_batch_mult < 1:
        raise ConfigurationError(f"mega_batch_mult must be >= 1, got {mega_batch_mult}")
    mega = mega_batch_mult * step_size
    megabatches = [
        sorted(perm[i : i + mega], key=lambda idx: -int(lengths[idx]))
        for i in range(0, len(perm), mega)
    ]
    if megabatches:
        # First of the megabatches with the longest head (the first of them on a tie).
        longest = max(range(len(megabatches)), key=lambda m: int(lengths[megabatches[m][0]]))
        first, top = megabatches[0], megabatches[longest]
        first[0], top[0] = top[0], first[0]
    flat = [idx for mb in megabatches for idx in mb]
    mine = flat[rank::world_size]
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def eval_length_grouped_order(lengths: Sequence[int], batch_size: int, *, seed: int) -> list[int]:
    """Order of the evaluation and prediction samples under ``group_by_length``, as transformers
    orders them: :func:`group_by_length_plan` of one epoch with a generator seeded with ``seed``
    (``data_seed``, else ``seed``), the same at every evaluation."""
    plan = group_by_length_plan(lengths, batch_size, seed=seed, epoch=0)
    return [idx for batch in plan for idx in batch]


def balanced_partition(lengths_desc: Sequence[int], parts: int) -> list[int]:
    """Split a length-sorted (longest first) run into ``parts`` contiguous non-empty groups.

    Minimises the largest padded cost (``first length * size``: the first is the longest), then
    evens out neighbouring groups without raising that maximum. Returns the group sizes.
    """
    n = len(lengths_desc)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} samples into {parts} non-empty groups")
    lens = [max(1, int(x)) for x in lengths_desc]  # empty samples still occupy a row
    if any(lens[i] < lens[i + 1] for i in range(n - 1)):
        raise ValueError("balanced_partition needs lengths sorted longest first")

    def greedy(cap: int) -> list[int] | None:
        sizes: list[int] = []
        i = 0
        while i < n:
            take = cap // lens[i]
            if take == 0 or len(sizes) == parts:
                return None
            take = min(take, n - i)
            sizes.append(take)
            i += take
        return sizes

    lo, hi = lens[0], lens[0] * math.ceil(n / parts)  # hi: equal counts is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    sizes = greedy(lo)
    assert sizes is not None
    cap = lo
    starts = [0]
    for s in sizes[:-1]:
        starts.append(starts[-1] + s)
    # Too few groups: split the costliest splittable group (a split never raises any cost).
    while len(sizes) < parts:
        costs = [lens[starts[g]] * sizes[g] if sizes[g] > 1 else -1 for g in range(len(sizes))]
        g = max(range(len(sizes)), key=lambda k: costs[k])
        half = sizes[g] // 2
        sizes[g : g + 1] = [sizes[g] - half, half]
        starts[g + 1 : g + 1] = [starts[g] + sizes[g]]

    # Level neighbours: move one sample across a boundary when that narrows the pair's gap and
    # keeps both under the optimal cap. Bounded passes keep it cheap and deterministic.
    def cost(g: int) -> int:
        return lens[starts[g]] * sizes[g]

    for _ in range(2 * n):
        changed = False
        for g in range(len(sizes) - 1):
            a, b = cost(g), cost(g + 1)
            # boundary right: group g grows, g+1 shrinks
            if sizes[g + 1] > 1:
                na = lens[starts[g]] * (sizes[g] + 1)
                nb = lens[starts[g + 1] + 1] * (sizes[g + 1] - 1)
                if max(na, nb) <= cap and abs(na - nb) < abs(a - b):
                    sizes[g] += 1
                    sizes[g + 1] -= 1
                    starts[g + 1] += 1
                    changed = True
                    continue
            # boundary left: group g shrinks, g+1 grows
            if sizes[g] > 1:
                na = lens[starts[g]] * (sizes[g] - 1)
                nb = lens[starts[g + 1] - 1] * (sizes[g + 1] + 1)
                if max(na, nb) <= cap and abs(na - nb) < abs(a - b):
                    sizes[g] -= 1
                    sizes[g + 1] += 1
                    starts[g + 1] -= 1
                    changed = True
        if not changed:
            break
    return sizes


def _per_rank_batch_counts(
    num_samples: int, batch_size: int, world_size: int, drop_last: bool
) -> tuple[int, int]:
    """(samples per rank, micro-batches per rank) of the plain resumable sampler."""
    per_rank = math.ceil(num_samples / world_size)
    if drop_last:
        n_batches = per_rank // batch_size
        return n_batches * batch_size, n_batches
    return per_rank, math.ceil(per_rank / batch_size)


def batch_rebalance_plan(
    lengths: Sequence[int],
    batch_size: int,
    *,
    seed: int,
    epoch: int,
    gradient_accumulation_steps: int = 1,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
    even_batches: bool = True,
) -> list[list[int]]:
    """This rank's micro-batches for one epoch of ``batch_rebalance``.

    Each optimizer step takes exactly the samples a plain sampler would give it (``world_size *
    gradient_accumulation_steps * batch_size``, fewer on the last step), sorts them by length and
    splits them into ``world_size * gradient_accumulation_steps`` contiguous micro-batches of about
    equal padded cost (``max length * count``): long samples travel in small micro-batches, short
    ones in large ones. Micro-step ``j`` of the step gets groups ``j * world_size`` to
    ``(j + 1) * world_size - 1`` (so the longest samples run first and the ranks of a micro-step
    carry similar cost), dealt so that the ranks' step totals stay even. Every rank gets as many
    micro-batches per epoch as with a plain sampler. ``even_batches=False``: no wrap-around, so
    the epoch's last step has fewer samples; it is cut into at most one group per sample and
    ranks left without a group get fewer micro-batches (the sampler pads them).
    """
    _check_common(lengths, batch_size, rank, world_size)
    accum = gradient_accumulation_steps
    if accum < 1:
        raise ConfigurationError(
            f"gradient_accumulation_steps must be >= 1, got {accum}: set a positive value"
        )
    perm = _epoch_permutation(len(lengths), seed, epoch)
    per_rank, n_batches = _per_rank_batch_counts(len(perm), batch_size, world_size, drop_last)
    if even_batches:
        perm = _pad_to_world(perm, world_size)
    batches: list[list[int]] = []
    consumed = 0
    for step_start in range(0, n_batches, accum):
        micro = min(accum, n_batches - step_start)
        # Samples per rank in this step: full micro-batches except the epoch's last one.
        step_rank_samples = min(micro * batch_size, per_rank - step_start * batch_size)
        pool = perm[consumed : consumed + step_rank_samples * world_size]
        consumed += len(pool)
        if not pool:
            break
        pool.sort(key=lambda idx: -int(lengths[idx]))
        # Unpadded (even_batches=False), the last pool may hold fewer samples than groups.
        parts = min(micro * world_size, len(pool))
        sizes = balanced_partition([int(lengths[i]) for i in pool], parts)
        groups: list[list[int]] = []
        start = 0
        for size in sizes:
            groups.append(pool[start : start + size])
            start += size
        batches.extend(_assign_to_ranks(groups, lengths, world_size, micro)[rank])
    return batches


def _assign_to_ranks(
    groups: list[list[int]], lengths: Sequence[int], world_size: int, micro: int
) -> list[list[list[int]]]:
    """Deal a step's groups (longest first) to the ranks, ``world_size`` per micro-step.

    Micro-step ``j`` gets groups ``j * world_size ...``: neighbours in cost, so the ranks finish
    that micro-step together. Within it the costliest group goes to the rank with the smallest
    running total, which also evens out the ranks' totals at the gradient sync.
    """
    totals = [0] * world_size
    per_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    for j in range(micro):
        chunk = groups[j * world_size : (j + 1) * world_size]
        chunk = sorted(chunk, key=lambda g: -padded_cost([int(lengths[i]) for i in g]))
        ranks = sorted(range(world_size), key=lambda r: (totals[r], r))
        # A short last chunk (even_batches=False) leaves the ranks with the largest totals out.
        for group, r in zip(chunk, ranks[: len(chunk)], strict=True):
            per_rank[r].append(group)
            totals[r] += padded_cost([int(lengths[i]) for i in group])
    return per_rank


# --------------------------------------------------------------------------------------------
# Resumable batch samplers (the protocol of trainer_runtime.data.samplers.ResumableBatchSampler)
# --------------------------------------------------------------------------------------------


class _LengthBatchSampler(ResumableBatchSampler):
    """Shared part: lengths, a cached per-epoch plan and a resume fingerprint."""

    strategy = "length"

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        even_batches: bool = True,
    ) -> None:
        _check_common(lengths, batch_size, rank, num_replicas)
        super().__init__(
            len(lengths),
            batch_size,
            seed=seed,
            drop_last=drop_last,
            num_replicas=num_replicas,
            rank=rank,
            even_batches=even_batches,
        )
        self.lengths = [int(x) for x in lengths]
        self._plan_cache: tuple[tuple[int, int, bool], list[list[int]]] | None = None

    def _make_plan(self, epoch: int) -> list[list[int]]:
        raise NotImplementedError

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        # Planning sorts and partitions the whole epoch: do it once per epoch (and per layout,
        # since even_batches may be set after construction).
        key = (epoch, self.rank, self.even_batches)
        if self._plan_cache is None or self._plan_cache[0] != key:
            self._plan_cache = (key, self._make_plan(epoch))
        return [list(b) for b in self._plan_cache[1]]

    def _fingerprint(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "num_samples": self.num_samples,
            "even_batches": self.even_batches,
        }

    def state_dict(self) -> dict[str, Any]:
        return {**self._fingerprint(), **super().state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Position at batch ``state["start"]`` of ``state["epoch"]``; refuses a different plan."""
        for key, value in self._fingerprint().items():
            if key in state and state[key] != value:
                raise ConfigurationError(
                    f"cannot resume the {self.strategy} sampler: the checkpoint has {key}="
                    f"{state[key]!r} but this run has {key}={value!r}; resume with the same "
                    "dataset, seed, batch size and world size (or set ignore_data_skip=True)"
                )
        super().load_state_dict(state)


class LengthGroupedBatchSampler(_LengthBatchSampler):
    """``train_sampling_strategy="group_by_length"``: similar lengths share a micro-batch.

    ``order_from_global_rng`` (what the Trainer asks for on one process): each epoch's
    permutation is drawn from the global torch RNG when the epoch begins, as transformers'
    sampler draws it, so the same seed gives the same batches and leaves the global RNG where
    transformers leaves it. The Trainer calls :meth:`begin_epoch` then and keeps what it returns
    in the checkpoint; a resume hands it back and the epoch's order is rebuilt from it without
    touching the global RNG. Otherwise (several ranks, which must agree on the order, or a
    sampler built directly) the permutation comes from ``seed + epoch``.
    """

    strategy = "group_by_length"

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        mega_batch_mult: int | None = None,
        even_batches: bool = True,
        gradient_accumulation_steps: int = 1,
        order_from_global_rng: bool = False,
    ) -> None:
        super().__init__(
            lengths,
            batch_size,
            seed=seed,
            drop_last=drop_last,
            num_replicas=num_replicas,
            rank=rank,
            even_batches=even_batches,
        )
        if gradient_accumulation_steps < 1:
            raise ConfigurationError(
                f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
            )
        self.mega_batch_mult = mega_batch_mult
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.order_from_global_rng = order_from_global_rng and num_replicas == 1
        # (epoch, state of the generator its permutation is drawn from)
        self._epoch_rng: tuple[int, torch.Tensor] | None = None

    def begin_epoch(self, epoch: int, saved: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """Fix ``epoch``'s order when its iterator starts; returns what a resume needs.

        ``saved`` None: the epoch starts afresh, its permutation is drawn from the global torch
        RNG (advancing it as transformers' sampler does). Otherwise ``saved`` is what this call
        returned for the run being resumed: the same permutation, the global RNG untouched. A
        record of another epoch or dataset (a checkpoint written before this existed) falls back
        to ``seed + epoch``, with a warning. Without ``order_from_global_rng``: nothing (None).
        """
        if not self.order_from_global_rng:
            return None
        self._plan_cache = None
        self._real_batches = None
        if saved is None:
            state = torch.get_rng_state()
            torch.randperm(self.num_samples)  # the draw transformers' sampler takes
        elif saved.get("epoch") == epoch and saved.get("num_samples") == self.num_samples:
            state = torch.frombuffer(
                bytearray(base64.b64decode(saved["rng_state"])), dtype=torch.uint8
            ).clone()
        else:
            logger.warning(
                "group_by_length: the checkpoint does not hold the order of epoch %d; this epoch "
                "is ordered from data_seed=%d instead (it differs from the interrupted run's)",
                epoch,
                self.seed,
            )
            self._epoch_rng = None
            return None
        self._epoch_rng = (epoch, state)
        return {
            "epoch": epoch,
            "num_samples": self.num_samples,
            "rng_state": base64.b64encode(state.numpy().tobytes()).decode("ascii"),
        }

    def _fingerprint(self) -> dict[str, Any]:
        return {
            **super()._fingerprint(),
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
        }

    def _make_plan(self, epoch: int) -> list[list[int]]:
        rng = self._epoch_rng
        return group_by_length_plan(
            self.lengths,
            self.batch_size,
            seed=self.seed,
            epoch=epoch,
            rank=self.rank,
            world_size=self.num_replicas,
            drop_last=self.drop_last,
            mega_batch_mult=self.mega_batch_mult,
            even_batches=self.even_batches,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            generator_state=rng[1] if rng is not None and rng[0] == epoch else None,
        )


class BatchRebalanceBatchSampler(_LengthBatchSampler):
    """``train_sampling_strategy="batch_rebalance"``: equal padded cost per micro-batch.

    ``batch_size`` is the *average* micro-batch size; the samples per optimizer step are those of
    a plain sampler. The training loop must group ``gradient_accumulation_steps`` consecutive
    micro-batches per optimizer step from the start of the epoch (and resume only at a step
    boundary, which a checkpoint always is).
    """

    strategy = "batch_rebalance"

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        gradient_accumulation_steps: int = 1,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        even_batches: bool = True,
    ) -> None:
        if gradient_accumulation_steps < 1:
            raise ConfigurationError(
                f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
            )
        super().__init__(
            lengths,
            batch_size,
            seed=seed,
            drop_last=drop_last,
            num_replicas=num_replicas,
            rank=rank,
            even_batches=even_batches,
        )
        self.gradient_accumulation_steps = gradient_accumulation_steps

    def _fingerprint(self) -> dict[str, Any]:
        extra = {"gradient_accumulation_steps": self.gradient_accumulation_steps}
        return {**super()._fingerprint(), **extra}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        start = int(state.get("start", 0))
        # The epoch's last step may be short, so its end need not be a multiple.
        at_end = start >= len(self.epoch_batches(int(state.get("epoch", 0))))
        if start % self.gradient_accumulation_steps and not at_end:
            raise ConfigurationError(
                f"batch_rebalance can resume only at an optimizer-step boundary: start={start} is "
                f"not a multiple of gradient_accumulation_steps={self.gradient_accumulation_steps}"
            )
        super().load_state_dict(state)

    def _make_plan(self, epoch: int) -> list[list[int]]:
        return batch_rebalance_plan(
            self.lengths,
            self.batch_size,
            seed=self.seed,
            epoch=epoch,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            rank=self.rank,
            world_size=self.num_replicas,
            drop_last=self.drop_last,
            even_batches=self.even_batches,
        )


def build_length_batch_sampler(
    strategy: str,
    dataset: Any,
    batch_size: int,
    *,
    seed: int,
    drop_last: bool = False,
    num_replicas: int = 1,
    rank: int = 0,
    gradient_accumulation_steps: int = 1,
    length_column_name: str = "length",
    model_input_name: str | None = None,
    lengths: Sequence[int] | None = None,
    parallelism: str = "data",
    even_batches: bool = True,
    order_from_global_rng: bool = False,
) -> ResumableBatchSampler:
    """The batch sampler for ``train_sampling_strategy`` ``group_by_length``/``batch_rebalance``.

    Lengths come from ``lengths``, else the ``length_column_name`` column, else one scan of the
    dataset (see :func:`infer_lengths`): build it before removing unused columns, or keep the
    length column. ``parallelism`` other than ``"data"`` is refused for ``batch_rebalance``.
    ``order_from_global_rng``: see :class:`LengthGroupedBatchSampler` (one process only).
    """
    if strategy not in LENGTH_STRATEGIES:
        raise ConfigurationError(
            f"train_sampling_strategy={strategy!r} is not length-based; expected one of "
            f"{', '.join(LENGTH_STRATEGIES)}"
        )
    if strategy == "batch_rebalance" and parallelism != "data":
        raise ConfigurationError(
            f"train_sampling_strategy='batch_rebalance' supports data parallel training only, "
            f"got parallelism={parallelism!r}: use 'group_by_length' or 'random' instead"
        )
    if lengths is None:
        lengths = infer_lengths(
            dataset, length_column_name=length_column_name, model_input_name=model_input_name
        )
    elif len(lengths) != len(dataset):
        raise ConfigurationError(
            f"got {len(lengths)} lengths for a dataset of {len(dataset)} items; pass one per item"
        )
    common: dict[str, Any] = {
        "seed": seed,
        "drop_last": drop_last,
        "num_replicas": num_replicas,
        "rank": rank,
        "even_batches": even_batches,
    }
    if strategy == "group_by_length":
        return LengthGroupedBatchSampler(
            lengths,
            batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            order_from_global_rng=order_from_global_rng,
            **common,
        )
    return BatchRebalanceBatchSampler(
        lengths, batch_size, gradient_accumulation_steps=gradient_accumulation_steps, **common
    )


def _factory(strategy: str) -> Callable[..., ResumableBatchSampler]:
    def make(dataset: Any, batch_size: int, **kwargs: Any) -> ResumableBatchSampler:
        return build_length_batch_sampler(strategy, dataset, batch_size, **kwargs)

    return make


# Same factory signature as the built-in strategies, plus the keyword-only options above.
for _name in LENGTH_STRATEGIES:
    BATCH_SAMPLERS.setdefault(_name, _factory(_name))
