"""train_sampling_strategy="group_by_length": grouping, sharding and exact resume."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests.unit.data._lengths import skewed_lengths
from trainer_runtime.data.length_sampling import (
    LengthGroupedBatchSampler,
    group_by_length_plan,
    padded_cost,
)
from trainer_runtime.data.samplers import BATCH_SAMPLERS, RandomBatchSampler, build_batch_sampler
from trainer_runtime.errors import ConfigurationError

LENGTHS = skewed_lengths(203, seed=3)


def run_epochs(sampler: Any, epochs: range) -> list[list[int]]:
    out: list[list[int]] = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        out.extend(sampler)
    return out


def padding_fraction(batches: list[list[int]], lengths: list[int]) -> float:
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(padded_cost([lengths[i] for i in b]) for b in batches)
    return 1 - real / padded


@pytest.mark.parametrize("drop_last", [False, True])
def test_single_rank_epoch_is_a_permutation(drop_last: bool) -> None:
    batches = group_by_length_plan(LENGTHS, 8, seed=1, epoch=0, drop_last=drop_last)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    if drop_last:
        assert all(len(b) == 8 for b in batches)
        assert len(flat) == (len(LENGTHS) // 8) * 8
    else:
        assert sorted(flat) == list(range(len(LENGTHS)))


def test_longest_sample_comes_first() -> None:
    batches = group_by_length_plan(LENGTHS, 8, seed=5, epoch=2)
    assert LENGTHS[batches[0][0]] == max(LENGTHS)


def test_less_padding_than_random() -> None:
    lengths = skewed_lengths(1000, seed=3)
    grouped = group_by_length_plan(lengths, 8, seed=1, epoch=0)
    random_order = list(RandomBatchSampler(len(lengths), 8, seed=1))
    assert padding_fraction(grouped, lengths) < padding_fraction(random_order, lengths) / 1.5


def test_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a = group_by_length_plan(LENGTHS, 8, seed=1, epoch=0)
    assert a == group_by_length_plan(LENGTHS, 8, seed=1, epoch=0)
    assert a != group_by_length_plan(LENGTHS, 8, seed=1, epoch=1)
    assert a != group_by_length_plan(LENGTHS, 8, seed=2, epoch=0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_are_disjoint_and_cover_the_dataset(world_size: int, drop_last: bool) -> None:
    per_rank = [
        group_by_length_plan(
            LENGTHS, 4, seed=7, epoch=1, rank=r, world_size=world_size, drop_last=drop_last
        )
        for r in range(world_size)
    ]
    # Every rank has the same number of batches (a shorter rank would hang a collective) and
    # as many as the plain resumable sampler.
    counts = {len(b) for b in per_rank}
    plain = len(RandomBatchSampler(len(LENGTHS), 4, num_replicas=world_size, drop_last=drop_last))
    assert counts == {plain}
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    padding = -len(LENGTHS) % world_size
    # Each sample once; only the wrap-around padding repeats samples.
    assert sum(c - 1 for c in seen.values()) <= padding
    if not drop_last:
        assert set(seen) == set(range(len(LENGTHS)))


def test_ranks_of_a_step_get_similar_lengths() -> None:
    world = 4
    per_rank = [
        group_by_length_plan(LENGTHS, 4, seed=0, epoch=0, rank=r, world_size=world)
        for r in range(world)
    ]
    for step in range(len(per_rank[0]) - 1):
        maxima = [max(LENGTHS[i] for i in per_rank[r][step]) for r in range(world)]
        mins = [min(LENGTHS[i] for i in per_rank[r][step]) for r in range(world)]
        # Sorted runs are dealt round-robin: every rank's range overlaps the others'.
        assert max(mins) <= min(maxima)


@pytest.mark.parametrize("world_size", [1, 3])
def test_resume_at_every_batch_equals_uninterrupted(world_size: int) -> None:
    for rank in range(world_size):
        kwargs = {"seed": 11, "num_replicas": world_size, "rank": rank}
        full = run_epochs(LengthGroupedBatchSampler(LENGTHS, 6, **kwargs), range(3))
        per_epoch = len(LengthGroupedBatchSampler(LENGTHS, 6, **kwargs))
        for stop in range(0, len(full) + 1, 5):
            first = LengthGroupedBatchSampler(LENGTHS, 6, **kwargs)
            done: list[list[int]] = []
            epoch, start = divmod(stop, per_epoch)
            for e in range(epoch):
                first.set_epoch(e)
                done.extend(first)
            first.set_epoch(epoch)
            done.extend(b for _, b in zip(range(start), first, strict=False))
            first.start = start  # the training loop records how far it got
            state = first.state_dict()

            resumed = LengthGroupedBatchSampler(LENGTHS, 6, **kwargs)
            resumed.load_state_dict(state)
            done.extend(resumed)
            for e in range(epoch + 1, 3):
                resumed.set_epoch(e)
                done.extend(resumed)
            assert done == full, f"rank {rank}: resume at batch {stop} diverged"


def test_resume_refuses_a_different_plan() -> None:
    state = LengthGroupedBatchSampler(LENGTHS, 6, seed=1).state_dict()
    with pytest.raises(ConfigurationError, match="seed"):
        LengthGroupedBatchSampler(LENGTHS, 6, seed=2).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="batch_size"):
        LengthGroupedBatchSampler(LENGTHS, 5, seed=1).load_state_dict(state)


def test_registered_with_the_base_factory() -> None:
    assert "group_by_length" in BATCH_SAMPLERS
    data = [{"input_ids": [0] * n} for n in LENGTHS]
    sampler = build_batch_sampler("group_by_length", data, 8, seed=1)
    assert isinstance(sampler, LengthGroupedBatchSampler)
    assert list(sampler) == group_by_length_plan(LENGTHS, 8, seed=1, epoch=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 2, "num_replicas": 2}, "rank"),
        ({"batch_size": 0}, "per_device_train_batch_size"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    args = {"batch_size": 4, **kwargs}
    with pytest.raises(ConfigurationError, match=match):
        LengthGroupedBatchSampler(LENGTHS, **args)
