"""Replicated state written by every rank: the save of a data-parallel (DDP) job split by bytes.

Under DDP every rank holds the same model and optimizer state. One rank writing all of it makes
the save as slow as one process's bandwidth (a 7B full fine-tune is about 98 GB: 14 GB of bf16
weights, 84 GB of fp32 Adam state), so the tensors are split across the ranks by bytes and each
rank writes its share at the same time:

* :func:`plan_shares` assigns every tensor of every group (the model's, the optimizer's) to a
  rank: largest first, each to the rank with the fewest bytes so far (ties: the lowest rank).
  Pure and deterministic, so every rank computes the same plan from the same names and sizes,
  with no collective. A rank's bytes are at most ``total / N`` plus the largest tensor (a tensor
  is never split).
* The ranks agree on the plan before writing (:func:`agree_on_plan`): each rank's digest of what
  it plans from (every tensor's group, name, dtype, shape, in order) is all-gathered (one small
  collective); when they differ (a tensor on one rank only, another shape or dtype), the save
  fails on every rank with a message naming the tensors (:func:`plan_disagreement`), before
  anything of the share is written, so no index can point at a shard without its tensor.
* Each group is written as transformers writes a sharded model:
  ``<stem>-00001-of-0000M.safetensors`` (one file per rank that holds any tensor of the group,
  numbered in rank order) and an index
  ``<stem>.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map":
  {tensor: file}}``) that the coordinator writes at the commit from what the ranks wrote: each
  rank's record names the tensors of its shards (:class:`ShardFile`), and the index
  (:class:`ShareIndex`) maps each to the shard that holds it, after checking that every tensor
  of the coordinator's plan is in exactly one shard. ``from_pretrained`` opens the model's
  shards; our resume reads the union at any world size (:func:`load_indexed`).

The group's safetensors metadata (e.g. tied-weight aliases) goes into every shard of the group;
metadata too large to repeat (the optimizer's structure) goes into the index only.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer_runtime.checkpoint.safetensors_stream import TensorFile
from trainer_runtime.errors import CheckpointError, ConfigurationError, ResumeError

__all__ = [
    "PlanItem",
    "ShardFile",
    "ShareGroup",
    "ShareIndex",
    "agree_on_plan",
    "index_name",
    "load_indexed",
    "plan_digest",
    "plan_disagreement",
    "plan_listing",
    "plan_shares",
    "shard_file_name",
    "shard_stem",
    "share_entries",
]

# The index's own format key (transformers reads "total_size" only and ignores the rest).
_INDEX_FORMAT_KEY = "preemptible.format"
_INDEX_FORMAT = "preemptible-shares/1"


def shard_file_name(stem: str, index: int, count: int) -> str:
    """transformers' name of shard ``index`` (1-based) of ``count``."""
    return f"{stem}-{index:05d}-of-{count:05d}.safetensors"


_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.safetensors$")


def shard_stem(filename: str) -> str | None:
    """The group stem of a shard file name (``model`` of ``model-00001-of-00002.safetensors``),
    or None; pure."""
    match = _SHARD.match(filename)
    return match.group("stem") if match else None


def index_name(stem: str) -> str:
    """The index of a sharded group, e.g. ``model.safetensors.index.json``."""
    return f"{stem}.safetensors.index.json"


def plan_shares(
    sizes: Sequence[tuple[str, int]], world_size: int
) -> tuple[list[list[str]], list[int]]:
    """Assign items ``(key, bytes)`` to ``world_size`` ranks; returns each rank's keys (in the
    order given) and its bytes.

    Largest first, each to the least loaded rank (ties: the lowest rank): the greedy
    "longest processing time" rule, within ``total / N + largest item`` of an even split.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"world_size={world_size!r} is invalid: use an int >= 1")
    keys = [k for k, _ in sizes]
    if len(set(keys)) != len(keys):
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        raise ConfigurationError(f"tensor names must be unique across a save: {dupes[:5]}")
    order = {k: i for i, k in enumerate(keys)}
    heap = [(0, rank) for rank in range(world_size)]
    owner: dict[str, int] = {}
    for key, nbytes in sorted(sizes, key=lambda kv: (-kv[1], order[kv[0]])):
        load, rank = heapq.heappop(heap)
        owner[key] = rank
        heapq.heappush(heap, (load + max(0, nbytes), rank))
    shares: list[list[str]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for key, nbytes in sizes:
        shares[owner[key]].append(key)
        loads[owner[key]] += max(0, nbytes)
    return shares, loads


@dataclass(frozen=True)
class ShareGroup:
    """Tensors saved as one sharded group (``stem`` names its files and its index).

    ``metadata`` goes into every shard's safetensors header; ``index_extra`` into the index
    only (written once, by the coordinator).
    """

    stem: str
    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str] | None = None
    index_extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardFile(TensorFile):
    """A rank's shard of a group: written like any TensorFile, and the writer records the names
    of its tensors for the index (:class:`ShareIndex`)."""


@dataclass(frozen=True)
class ShareIndex:
    """A group's index, still to be written: the coordinator builds it at the commit from the
    tensors every rank's shards hold (:meth:`build`). ``planned``: the tensor names of the
    coordinator's plan (every one must be in exactly one shard)."""

    stem: str
    total_size: int
    planned: tuple[str, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)

    def build(self, written: Mapping[str, Sequence[str]], where: str) -> bytes:
        """The index's bytes from ``written`` (shard file -> the tensors it holds, every rank's
        shards; files of other groups are ignored). CheckpointError naming the tensors when a
        tensor is in two shards, or the shards miss a planned tensor or hold one not planned."""
        weight_map: dict[str, str] = {}
        twice: list[str] = []
        for file in sorted(written):
            if shard_stem(file) != self.stem:
                continue
            for name in written[file]:
                if name in weight_map:
                    twice.append(f"{name!r} ({weight_map[name]}, {file})")
                weight_map[name] = file
        missing = sorted(set(self.planned) - set(weight_map))
        unplanned = sorted(set(weight_map) - set(self.planned))
        problems = []
        if twice:
            problems.append(f"in two shards: {', '.join(twice[:5])}")
        if missing:
            problems.append(f"planned but in no shard: {missing[:5]}")
        if unplanned:
            problems.append(f"in a shard but not planned: {unplanned[:5]}")
        if problems:
            raise CheckpointError(
                f"{where}: the shards the ranks wrote do not match the plan of "
                f"{index_name(self.stem)} ({'; '.join(problems)}); not committed"
            )
        index = {
            "metadata": {"total_size": self.total_size, _INDEX_FORMAT_KEY: _INDEX_FORMAT},
            **dict(self.extra),
            "weight_map": dict(sorted(weight_map.items())),
        }
        return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode("utf-8")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# One tensor as the plan sees it: (group stem, name, dtype, shape).
PlanItem = tuple[str, str, str, tuple[int, ...]]
# Every rank's object in, every rank's list out (rank order): an all-gather of objects.
Gather = Callable[[Any], list[Any]]


def plan_listing(groups: Sequence[ShareGroup]) -> list[PlanItem]:
    """What :func:`share_entries` plans from, in its order: every tensor's group, name, dtype
    and shape (its bytes follow from the last two); pure."""
    return [
        (g.stem, name, str(t.dtype).removeprefix("torch."), tuple(int(d) for d in t.shape))
        for g in groups
        for name, t in g.tensors.items()
    ]


def plan_digest(listing: Sequence[PlanItem], world_size: int) -> str:
    """A digest of a plan's inputs (the same on every rank iff the ranks plan the same); pure."""
    text = json.dumps([world_size, [list(item) for item in listing]], separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _describe(item: PlanItem) -> str:
    return f"{item[2]}{list(item[3])}"


def plan_disagreement(listings: Sequence[Sequence[PlanItem]], *, limit: int = 5) -> str | None:
    """What the ranks' listings (rank order) disagree on, naming the tensors, or None when they
    agree; pure. Tensors missing on some ranks, tensors of another dtype or shape, and else the
    first position where the order differs."""
    keyed = [{(item[0], item[1]): tuple(item) for item in items} for items in listings]
    names = sorted({key for ranks in keyed for key in ranks})
    everywhere = range(len(listings))
    problems: list[str] = []
    for key in names:
        has = [r for r in everywhere if key in keyed[r]]
        label = f"{key[0]} tensor {key[1]!r}"
        if len(has) < len(listings):
            lacking = [r for r in everywhere if r not in has]
            problems.append(
                f"{label} is on rank(s) {', '.join(map(str, has))} only (not on "
                f"{', '.join(map(str, lacking))})"
            )
            continue
        kinds = {_describe(keyed[r][key]) for r in everywhere}
        if len(kinds) > 1:
            each = ", ".join(f"rank {r}: {_describe(keyed[r][key])}" for r in everywhere)
            problems.append(f"{label} differs ({each})")
    if not problems:
        first = [list(items) for items in listings]
        for r in everywhere:
            if first[r] != first[0]:
                at = next(
                    (i for i, (a, b) in enumerate(zip(first[0], first[r], strict=False)) if a != b),
                    min(len(first[0]), len(first[r])),
                )
                a = first[0][at][1] if at < len(first[0]) else None
                b = first[r][at][1] if at < len(first[r]) else None
                problems.append(
                    f"the tensors come in another order on rank {r} (position {at}: "
                    f"{a!r} on rank 0, {b!r} on rank {r})"
                )
                break
    if not problems:
        return None
    more = f"; and {len(problems) - limit} more" if len(problems) > limit else ""
    return "; ".join(problems[:limit]) + more


def agree_on_plan(groups: Sequence[ShareGroup], world_size: int, gather: Gather) -> None:
    """Every rank calls it with its groups before writing its share: the plan digests are
    all-gathered; CheckpointError on every rank, naming the tensors, when they differ (a second
    all-gather, of the listings, on that path only)."""
    listing = plan_listing(groups)
    digests = gather(plan_digest(listing, world_size))
    if len(set(digests)) <= 1:
        return
    listings = gather(listing)
    detail = plan_disagreement(listings) or "their plans differ"
    raise CheckpointError(
        f"the ranks disagree on the tensors of the checkpoint, so no rank writes its share: "
        f"{detail}. Every rank must hold the same model and optimizer state (names, dtypes, "
        "shapes) under data parallelism"
    )


def share_entries(
    groups: Sequence[ShareGroup], rank: int, world_size: int, *, coordinator: bool
) -> list[tuple[str, ShardFile | ShareIndex]]:
    """This rank's files of ``groups`` split across ``world_size`` ranks: its shards (as
    ShardFiles, written as they are serialised) and, on the coordinator, every group's index (a
    ShareIndex: CheckpointWriter builds it at the commit from what the ranks wrote).

    Every rank must pass the same groups (names, shapes, dtypes): the plan is computed from them
    on each rank independently.
    """
    if not 0 <= rank < world_size:
        raise ConfigurationError(f"rank={rank!r} must be within [0, {world_size})")
    items = [(f"{g.stem}\0{name}", _nbytes(t)) for g in groups for name, t in g.tensors.items()]
    shares, _ = plan_shares(items, world_size)
    owner = {key: r for r, keys in enumerate(shares) for key in keys}
    entries: list[tuple[str, ShardFile | ShareIndex]] = []
    for group in groups:
        holders = sorted({owner[f"{group.stem}\0{name}"] for name in group.tensors})
        count = len(holders)
        files = {r: shard_file_name(group.stem, i + 1, count) for i, r in enumerate(holders)}
        if rank in files:
            mine = {
                name: t
                for name, t in group.tensors.items()
                if owner[f"{group.stem}\0{name}"] == rank
            }
            entries.append((files[rank], ShardFile(mine, dict(group.metadata or {}) or None)))
        if coordinator:
            index = ShareIndex(
                group.stem,
                sum(_nbytes(t) for t in group.tensors.values()),
                tuple(group.tensors),
                dict(group.index_extra),
            )
            entries.append((index_name(group.stem), index))
    return entries


LoadFile = Callable[[str], tuple[dict[str, torch.Tensor], dict[str, str]]]


def load_indexed(
    index: Mapping[str, Any], load: LoadFile, where: str
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The union of the shards an index lists: every tensor of the weight map, and the shards'
    safetensors metadata merged (our shards of one group carry the same metadata).

    ``load(file)`` returns a shard's (tensors, metadata). Raises ResumeError when a tensor the
    index maps is not in its shard.
    """
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping):
        raise ResumeError(f"{where}: the index has no weight_map")
    # (an empty map is valid: an optimizer without state tensors, e.g. SGD without momentum)
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for shard in sorted(set(weight_map.values())):
        got, meta = load(str(shard))
        tensors.update(got)
        metadata.update(meta)
    missing = sorted(name for name in weight_map if name not in tensors)
    if missing:
        raise ResumeError(
            f"{where}: {len(missing)} tensor(s) of the index are not in their shards "
            f"({missing[:5]}{' ...' if len(missing) > 5 else ''})"
        )
    return tensors, metadata
