"""train_sampling_strategy="group_by_length": grouping, sharding and exact resume."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import torch

from tests.unit.data._lengths import skewed_lengths
from trainer_runtime.data.length_sampling import (
    LengthGroupedBatchSampler,
    eval_length_grouped_order,
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


# -- transformers' order (issue 37, item 10) -------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "batch_size", "accumulation", "seed"),
    [
        (203, 8, 1, 0),  # megabatches of 6 batches
        (203, 4, 2, 1),  # accumulation enlarges the megabatch, as transformers' does
        (64, 4, 1, 2),
        (30, 8, 1, 3),  # tiny: megabatches of one batch
        (1000, 2, 1, 4),  # the multiplier's cap of 50
        (17, 3, 3, 5),  # a short last batch
    ],
)
def test_plan_is_transformers_length_grouped_order(
    n: int, batch_size: int, accumulation: int, seed: int
) -> None:
    """The same permutation gives transformers' order: megabatches of 4 steps at most 50
    times, sorted longest first with ties in permutation order, the longest sample first."""
    pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    lengths = skewed_lengths(n, seed=seed)
    state = torch.Generator().manual_seed(100 + seed).get_state()
    ours = group_by_length_plan(
        lengths,
        batch_size,
        seed=0,
        epoch=0,
        gradient_accumulation_steps=accumulation,
        generator_state=state,
    )
    generator = torch.Generator()
    generator.set_state(state)
    theirs = pt_utils.get_length_grouped_indices(
        lengths, batch_size * accumulation, generator=generator
    )
    assert [i for b in ours for i in b] == theirs
    assert all(len(b) == batch_size for b in ours[:-1])


def test_order_from_the_global_rng_when_the_epoch_begins() -> None:
    """A fresh epoch draws its permutation from the global RNG (advancing it as one randperm of
    the dataset does); a resume rebuilds the order from the record, the global RNG untouched."""
    sampler = LengthGroupedBatchSampler(LENGTHS, 8, seed=1, order_from_global_rng=True)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    record = sampler.begin_epoch(0, None)
    after = torch.get_rng_state()
    first = list(sampler)
    torch.set_rng_state(before)
    torch.randperm(len(LENGTHS))
    assert torch.equal(torch.get_rng_state(), after)  # one randperm's worth, as transformers

    torch.manual_seed(7)
    assert list(sampler) == first  # the order was fixed at begin_epoch
    generator = torch.Generator()
    generator.set_state(before)
    flat = [i for b in first for i in b]
    assert flat == group_by_length_plan_flat(LENGTHS, 8, generator)

    resumed = LengthGroupedBatchSampler(LENGTHS, 8, seed=1, order_from_global_rng=True)
    resumed.load_state_dict({"epoch": 0, "start": 3})
    torch.manual_seed(123)
    untouched = torch.get_rng_state()
    assert record is not None
    assert resumed.begin_epoch(0, json.loads(json.dumps(record))) == record
    assert torch.equal(torch.get_rng_state(), untouched)
    assert list(resumed) == first[3:]


def group_by_length_plan_flat(lengths: list[int], batch_size: int, generator: Any) -> list[int]:
    plan = group_by_length_plan(
        lengths, batch_size, seed=0, epoch=0, generator_state=generator.get_state()
    )
    return [i for b in plan for i in b]


def test_a_record_of_another_epoch_falls_back_to_the_seed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sampler = LengthGroupedBatchSampler(LENGTHS, 8, seed=1, order_from_global_rng=True)
    record = sampler.begin_epoch(0, None)
    assert record is not None
    resumed = LengthGroupedBatchSampler(LENGTHS, 8, seed=1, order_from_global_rng=True)
    resumed.set_epoch(1)
    with caplog.at_level("WARNING", logger="trainer_runtime.data.length_sampling"):
        assert resumed.begin_epoch(1, record) is None
    assert "does not hold the order of epoch 1" in caplog.text
    assert list(resumed) == group_by_length_plan(LENGTHS, 8, seed=1, epoch=1)


@pytest.mark.parametrize("ranks", [1, 2])
def test_seeded_order_without_the_global_rng(ranks: int) -> None:
    """Built directly, or with several ranks (which must agree): the order comes from
    seed + epoch and begin_epoch neither records nor draws anything."""
    sampler = LengthGroupedBatchSampler(
        LENGTHS, 8, seed=1, num_replicas=ranks, order_from_global_rng=True
    )
    assert sampler.order_from_global_rng is (ranks == 1)
    if ranks == 1:
        sampler = LengthGroupedBatchSampler(LENGTHS, 8, seed=1)
    state = torch.get_rng_state()
    assert sampler.begin_epoch(0, None) is None
    assert torch.equal(torch.get_rng_state(), state)
    assert list(sampler) == group_by_length_plan(
        LENGTHS, 8, seed=1, epoch=0, world_size=ranks, rank=0
    )


@pytest.mark.parametrize(("n", "batch_size", "seed"), [(203, 8, 42), (24, 4, 0), (7, 3, 5)])
def test_evaluation_order_is_transformers(n: int, batch_size: int, seed: int) -> None:
    """transformers' evaluation sampler under group_by_length: its length-grouped sampler with a
    generator seeded with data_seed/seed, the same order at every evaluation."""
    pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    lengths = skewed_lengths(n, seed=seed)
    theirs = pt_utils.LengthGroupedSampler(
        batch_size, lengths=lengths, generator=torch.Generator().manual_seed(seed)
    )
    ours = eval_length_grouped_order(lengths, batch_size, seed=seed)
    assert ours == list(theirs)
    assert sorted(ours) == list(range(n))
