"""accelerator_config sharding math: even_batches=False (no wrap-around, padding micro-batches)
and dispatch_batches (the main process builds every rank's batch) for every sampling strategy."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from trainer_runtime.data.dispatch import (
    GlobalBatchSampler,
    PaddingBatch,
    SplitCollate,
    SplitStream,
    TaggedDataset,
    split_counts,
)
from trainer_runtime.data.length_sampling import (
    BatchRebalanceBatchSampler,
    LengthGroupedBatchSampler,
)
from trainer_runtime.data.samplers import (
    RandomBatchSampler,
    ResumableBatchSampler,
    SequentialBatchSampler,
)
from trainer_runtime.features.evaluation import UnevenEvalBatchSampler, uneven_eval_batches

Factory = Callable[..., ResumableBatchSampler]


def _lengths(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randint(1, 64) for _ in range(n)]


STRATEGIES: dict[str, Callable[[int, int], Factory]] = {
    "random": lambda n, b: lambda **kw: RandomBatchSampler(n, b, **kw),
    "sequential": lambda n, b: lambda **kw: SequentialBatchSampler(n, b, **kw),
    "group_by_length": lambda n, b: lambda **kw: LengthGroupedBatchSampler(_lengths(n), b, **kw),
    "batch_rebalance": lambda n, b: (
        lambda **kw: BatchRebalanceBatchSampler(_lengths(n), b, gradient_accumulation_steps=2, **kw)
    ),
}

# (samples, world, batch): divisible, one rank short of a batch, ranks without any sample, ...
SHAPES = [(48, 2, 4), (41, 2, 4), (41, 3, 4), (17, 4, 2), (3, 4, 1), (5, 4, 2), (1, 2, 3)]


def _ranks(strategy: str, n: int, world: int, batch: int, **kw: Any) -> list[Any]:
    make = STRATEGIES[strategy](n, batch)
    return [make(seed=7, num_replicas=world, rank=r, **kw) for r in range(world)]


def _real(sampler: ResumableBatchSampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return [i for k, b in enumerate(sampler) if not sampler.is_padding(epoch, k) for i in b]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize(("n", "world", "batch"), SHAPES)
def test_uneven_epoch_sees_every_sample_once(strategy: str, n: int, world: int, batch: int) -> None:
    samplers = _ranks(strategy, n, world, batch, even_batches=False)
    for epoch in (0, 1):
        lengths = {len(list(s)) for s in samplers}
        assert lengths == {len(samplers[0])}, "every rank yields len(self) batches"
        seen = [i for s in samplers for i in _real(s, epoch)]
        assert sorted(seen) == list(range(n)), f"epoch {epoch}: {sorted(seen)}"


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize(("n", "world", "batch"), SHAPES)
def test_even_batches_true_is_unchanged(strategy: str, n: int, world: int, batch: int) -> None:
    default = _ranks(strategy, n, world, batch)
    explicit = _ranks(strategy, n, world, batch, even_batches=True)
    for a, b in zip(default, explicit, strict=True):
        assert list(a) == list(b)
        assert not any(a.is_padding(0, k) for k in range(len(a)))
    seen = [i for s in default for b in s for i in b]
    assert set(seen) == set(range(n)) and len(seen) >= n  # wrap-around repeats some


@pytest.mark.parametrize(
    ("strategy", "n", "world", "batch", "padding"),
    [
        # 41 over 2 ranks: rank 1 has 20 samples = 5 batches of 4, rank 0 has 6 (the last of 1)
        ("random", 41, 2, 4, [(1, 5)]),
        ("sequential", 41, 2, 4, [(1, 5)]),
        ("group_by_length", 41, 2, 4, [(1, 5)]),
        # batch_rebalance cuts the last step (9 samples) into 4 groups: nobody pads
        ("batch_rebalance", 41, 2, 4, []),
        ("sequential", 48, 2, 4, []),
        ("sequential", 17, 4, 2, [(1, 2), (2, 2), (3, 2)]),
        ("sequential", 3, 4, 1, [(3, 0)]),
        ("batch_rebalance", 3, 4, 1, [(3, 0)]),
    ],
)
def test_padding_positions(
    strategy: str, n: int, world: int, batch: int, padding: list[tuple[int, int]]
) -> None:
    samplers = _ranks(strategy, n, world, batch, even_batches=False)
    found = [(r, k) for r, s in enumerate(samplers) for k in range(len(s)) if s.is_padding(0, k)]
    assert found == padding
    for r, k in found:
        # a padding batch is one real index, so it can be loaded and collated like any other
        (pad,) = [list(samplers[r])[k]]
        assert len(pad) == 1 and 0 <= pad[0] < n


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize(("n", "world", "batch"), [(41, 2, 4), (17, 4, 2), (3, 4, 1)])
def test_dispatch_builds_every_ranks_own_batches(
    strategy: str, even: bool, n: int, world: int, batch: int
) -> None:
    samplers = _ranks(strategy, n, world, batch, even_batches=even)
    main = samplers[0]
    for start in (0, 2):  # a step boundary (batch_rebalance accumulates 2)
        for s in samplers:
            s.load_state_dict({"epoch": 1, "start": start})
        global_batches = list(GlobalBatchSampler(main))
        per_rank = [list(s) for s in samplers]
        assert len(global_batches) == len(per_rank[0])
        for k, tagged in enumerate(global_batches):
            for r in range(world):
                assert [i for rank, i, _ in tagged if rank == r] == per_rank[r][k]
                flags = {pad for rank, _, pad in tagged if rank == r}
                assert flags == {samplers[r].is_padding(1, start + k)}


def test_split_collate_collates_each_rank_and_marks_padding() -> None:
    data = [{"x": torch.tensor([float(i)])} for i in range(6)]
    tagged = TaggedDataset(data)
    items = [tagged[(0, 1, False)], tagged[(0, 2, False)], tagged[(1, 3, True)]]

    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([r["x"] for r in rows])}

    first, second = SplitCollate(collate, 2)(items)
    assert not isinstance(first, PaddingBatch) and first["x"].flatten().tolist() == [1.0, 2.0]
    assert isinstance(second, PaddingBatch) and second["x"].flatten().tolist() == [3.0]


@pytest.mark.parametrize(
    ("total", "batch", "world", "expected"),
    [(8, 4, 2, [4, 4]), (5, 4, 2, [4, 1]), (3, 4, 2, [3, 0]), (7, 2, 4, [2, 2, 2, 1])],
)
def test_split_counts(total: int, batch: int, world: int, expected: list[int]) -> None:
    assert split_counts(total, batch, world) == expected


@pytest.mark.parametrize(
    ("even", "items", "expected", "padding"),
    [
        (False, [0, 1, 2], [[0, 1], [2]], [False, False]),
        (False, [0], [[0], [0]], [False, True]),
        (True, [0, 1, 2], [[0, 1], [2, 0]], [False, False]),
        (True, [0], [[0, 0], [0, 0]], [False, False]),
    ],
)
def test_split_stream(
    even: bool, items: list[int], expected: list[list[int]], padding: list[bool]
) -> None:
    shares = SplitStream(lambda rows: {"i": list(rows)}, 2, 2, even_batches=even)(items)
    assert [s["i"] for s in shares] == expected
    assert [isinstance(s, PaddingBatch) for s in shares] == padding


@pytest.mark.parametrize(
    ("n", "batch", "world", "rank", "drop_last", "expected"),
    [
        (33, 8, 2, 0, False, [list(range(0, 8)), list(range(16, 24)), [32]]),
        (33, 8, 2, 1, False, [list(range(8, 16)), list(range(24, 32)), None]),
        (33, 8, 2, 1, True, [list(range(8, 16)), list(range(24, 32))]),
        (3, 2, 4, 2, False, [None]),
        (16, 8, 2, 1, False, [list(range(8, 16))]),
    ],
)
def test_uneven_eval_batches(
    n: int, batch: int, world: int, rank: int, drop_last: bool, expected: list[Any]
) -> None:
    assert uneven_eval_batches(n, batch, world, rank, drop_last=drop_last) == expected


@pytest.mark.parametrize(("n", "batch", "world"), [(33, 8, 2), (3, 2, 4), (50, 7, 3)])
def test_uneven_eval_covers_the_set_once_in_order(n: int, batch: int, world: int) -> None:
    samplers = [UnevenEvalBatchSampler(n, batch, world_size=world, rank=r) for r in range(world)]
    assert len({len(s) for s in samplers}) == 1
    order = []
    for k in range(len(samplers[0])):  # the gather concatenates ranks in order, round by round
        for s in samplers:
            if not s.is_padding(k):
                order.extend(list(s)[k])
    assert order == list(range(n))
