"""train_sampling_strategy="batch_rebalance": balanced micro-batches, same samples per step."""

from __future__ import annotations

import itertools
import random
import statistics
from collections import Counter
from typing import Any

import pytest

from tests.unit.data._lengths import lognormal_lengths, skewed_lengths
from trainer_runtime.data.length_sampling import (
    BatchRebalanceBatchSampler,
    balanced_partition,
    batch_rebalance_plan,
    build_length_batch_sampler,
    group_by_length_plan,
    padded_cost,
)
from trainer_runtime.data.samplers import RandomBatchSampler
from trainer_runtime.errors import ConfigurationError

LENGTHS = skewed_lengths(301, seed=11)
BALANCE = lognormal_lengths(2000, seed=2)


def group_costs(lengths: list[int], sizes: list[int]) -> list[int]:
    costs, start = [], 0
    for size in sizes:
        costs.append(lengths[start] * size)
        start += size
    return costs


def brute_force_best_max(lengths: list[int], parts: int) -> int:
    n = len(lengths)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = [0, *cuts, n]
        sizes = [bounds[i + 1] - bounds[i] for i in range(parts)]
        worst = max(group_costs(lengths, sizes))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@pytest.mark.parametrize(
    ("lengths", "parts", "sizes"),
    [
        ([5, 5, 5, 5], 2, [2, 2]),
        ([5, 5, 5, 5], 4, [1, 1, 1, 1]),
        ([100, 10, 10, 10, 10, 10, 10, 10, 10, 10], 2, [1, 9]),
        ([8, 4, 4, 2, 2, 2, 2], 3, [1, 2, 4]),
        ([3], 1, [1]),
        ([0, 0, 0], 3, [1, 1, 1]),
    ],
)
def test_balanced_partition_table(lengths: list[int], parts: int, sizes: list[int]) -> None:
    assert balanced_partition(lengths, parts) == sizes


def test_balanced_partition_is_optimal_for_the_largest_cost() -> None:
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        lengths = sorted((rng.randint(1, 60) for _ in range(n)), reverse=True)
        sizes = balanced_partition(lengths, parts)
        assert len(sizes) == parts and all(s >= 1 for s in sizes) and sum(sizes) == n
        assert max(group_costs(lengths, sizes)) == brute_force_best_max(lengths, parts)


@pytest.mark.parametrize(("lengths", "parts"), [([1, 2], 1), ([3, 3], 3), ([3], 0)])
def test_balanced_partition_rejects_bad_input(lengths: list[int], parts: int) -> None:
    with pytest.raises(ValueError):
        balanced_partition(lengths, parts)


def steps_of(batches_per_rank: list[list[list[int]]], accum: int) -> list[list[list[int]]]:
    """Micro-batches of every rank grouped per optimizer step."""
    n = len(batches_per_rank[0])
    return [
        [b for rank_batches in batches_per_rank for b in rank_batches[s : s + accum]]
        for s in range(0, n, accum)
    ]


CONFIGS = [(1, 1), (1, 4), (2, 1), (2, 3), (4, 2), (3, 5)]


@pytest.mark.parametrize(("world", "accum"), CONFIGS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_each_step_trains_the_same_samples_as_the_random_sampler(
    world: int, accum: int, drop_last: bool
) -> None:
    kw: dict[str, Any] = {"seed": 4, "drop_last": drop_last}
    rebalanced = [
        batch_rebalance_plan(
            LENGTHS, 4, epoch=2, gradient_accumulation_steps=accum, rank=r, world_size=world, **kw
        )
        for r in range(world)
    ]
    plain = []
    for r in range(world):
        sampler = RandomBatchSampler(len(LENGTHS), 4, num_replicas=world, rank=r, **kw)
        sampler.set_epoch(2)
        plain.append(list(sampler))
    # Same micro-batch count per rank (len() of the sampler and the trainer's step math hold).
    assert {len(b) for b in rebalanced} == {len(plain[0])}
    for got, want in zip(steps_of(rebalanced, accum), steps_of(plain, accum), strict=True):
        assert Counter(i for b in got for i in b) == Counter(i for b in want for i in b)
        assert all(len(b) >= 1 for b in got)


def cv(costs: list[int]) -> float:
    """Spread of micro-batch padded costs within one step: std / mean."""
    return statistics.pstdev(costs) / statistics.mean(costs)


def per_step_costs(batches_per_rank: list[list[list[int]]], accum: int) -> list[list[int]]:
    return [
        [padded_cost([BALANCE[i] for i in b]) for b in step]
        for step in steps_of(batches_per_rank, accum)
    ]


def sync_idle(batches_per_rank: list[list[list[int]]], accum: int) -> float:
    """Mean share of time ranks wait at the gradient sync (time ~ padded tokens)."""
    idle = []
    for s in range(0, len(batches_per_rank[0]), accum):
        totals = [
            sum(padded_cost([BALANCE[i] for i in b]) for b in rank[s : s + accum])
            for rank in batches_per_rank
        ]
        idle.append(1 - statistics.mean(totals) / max(totals))
    return statistics.mean(idle)


@pytest.mark.parametrize(("world", "accum"), [(2, 4), (4, 2), (8, 1)])
def test_rebalance_lowers_cost_spread_idle_and_peak(world: int, accum: int) -> None:
    rebalanced = [
        batch_rebalance_plan(
            BALANCE, 4, seed=9, epoch=0, gradient_accumulation_steps=accum, rank=r, world_size=world
        )
        for r in range(world)
    ]
    grouped = [
        group_by_length_plan(BALANCE, 4, seed=9, epoch=0, rank=r, world_size=world)
        for r in range(world)
    ]
    plain = [
        list(RandomBatchSampler(len(BALANCE), 4, seed=9, num_replicas=world, rank=r))
        for r in range(world)
    ]
    reb_costs, rnd_costs = per_step_costs(rebalanced, accum), per_step_costs(plain, accum)
    # Same samples per step as random: spread, straggler and sync idle all drop.
    assert statistics.mean(map(cv, reb_costs)) < 0.5 * statistics.mean(map(cv, rnd_costs))
    assert sync_idle(rebalanced, accum) < 0.5 * sync_idle(plain, accum)
    for r_costs, p_costs in zip(reb_costs, rnd_costs, strict=True):
        assert max(r_costs) <= max(p_costs)
    # Long samples travel in small micro-batches: a far lower peak than group_by_length.
    peak = max(max(c) for c in reb_costs)
    assert peak < max(max(c) for c in per_step_costs(grouped, accum))


def test_longest_micro_batch_runs_first_and_is_smallest() -> None:
    batches = batch_rebalance_plan(LENGTHS, 8, seed=0, epoch=0, gradient_accumulation_steps=4)
    step = batches[:4]
    firsts = [max(LENGTHS[i] for i in b) for b in step]
    assert firsts == sorted(firsts, reverse=True)
    assert len(step[0]) <= len(step[-1])
    assert sum(len(b) for b in step) == 32


@pytest.mark.parametrize(("world", "accum"), [(1, 3), (2, 2)])
def test_resume_at_every_step_equals_uninterrupted(world: int, accum: int) -> None:
    for rank in range(world):
        kw = {"seed": 5, "num_replicas": world, "rank": rank, "gradient_accumulation_steps": accum}

        def run(sampler: BatchRebalanceBatchSampler, epochs: range) -> list[list[int]]:
            out: list[list[int]] = []
            for epoch in epochs:
                sampler.set_epoch(epoch)
                out.extend(sampler)
            return out

        full = run(BatchRebalanceBatchSampler(LENGTHS, 4, **kw), range(2))
        per_epoch = len(BatchRebalanceBatchSampler(LENGTHS, 4, **kw))
        for stop in [*range(0, per_epoch, accum), *range(per_epoch, 2 * per_epoch, accum * 3)]:
            epoch, start = divmod(stop, per_epoch)
            done = full[:stop]
            state = {**BatchRebalanceBatchSampler(LENGTHS, 4, **kw).state_dict()}
            state.update(epoch=epoch, start=start)
            resumed = BatchRebalanceBatchSampler(LENGTHS, 4, **kw)
            resumed.load_state_dict(state)
            done = done + list(resumed)
            if epoch == 0:
                done += run(resumed, range(1, 2))
            assert done == full, f"rank {rank}: resume at micro-batch {stop} diverged"


def test_resume_only_at_a_step_boundary() -> None:
    sampler = BatchRebalanceBatchSampler(LENGTHS, 4, gradient_accumulation_steps=3)
    with pytest.raises(ConfigurationError, match="optimizer-step boundary"):
        sampler.load_state_dict({"epoch": 0, "start": 4})
    # The end of the epoch (after a short last step) is a boundary too.
    end = len(sampler)
    assert end % 3
    sampler.load_state_dict({"epoch": 0, "start": end})
    assert list(sampler) == []


def test_resume_refuses_other_accumulation() -> None:
    state = BatchRebalanceBatchSampler(LENGTHS, 4, gradient_accumulation_steps=2).state_dict()
    with pytest.raises(ConfigurationError, match="gradient_accumulation_steps"):
        BatchRebalanceBatchSampler(LENGTHS, 4, gradient_accumulation_steps=4).load_state_dict(state)


def test_data_parallel_only() -> None:
    data = [{"input_ids": [0] * n} for n in LENGTHS]
    with pytest.raises(ConfigurationError, match="data parallel"):
        build_length_batch_sampler("batch_rebalance", data, 4, seed=0, parallelism="tensor")
    sampler = build_length_batch_sampler("batch_rebalance", data, 4, seed=0)
    assert isinstance(sampler, BatchRebalanceBatchSampler)


def test_lengths_must_match_dataset() -> None:
    with pytest.raises(ConfigurationError, match="one per item"):
        build_length_batch_sampler("group_by_length", [1, 2, 3], 2, seed=0, lengths=[1, 2])
