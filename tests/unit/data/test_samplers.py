from __future__ import annotations

import pytest

from trainer_runtime.data.samplers import (
    RandomBatchSampler,
    SequentialBatchSampler,
    build_batch_sampler,
)


def epoch_stream(sampler, epochs: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out: list[list[int]] = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.extend(list(sampler))
    return out


@pytest.mark.parametrize("cls", [RandomBatchSampler, SequentialBatchSampler])
@pytest.mark.parametrize(("n", "bs", "drop_last"), [(10, 3, False), (10, 3, True), (8, 4, False)])
@pytest.mark.parametrize("resume_at", [0, 1, 2, 3])
def test_resume_continues_the_same_order(
    cls, n: int, bs: int, drop_last: bool, resume_at: int
) -> None:  # type: ignore[no-untyped-def]
    reference = cls(n, bs, seed=7, drop_last=drop_last)
    full = [list(reference.epoch_batches(e)) for e in range(2)]
    for epoch in range(2):
        resumed = cls(n, bs, seed=7, drop_last=drop_last)
        resumed.load_state_dict({"epoch": epoch, "start": resume_at})
        assert resumed.state_dict() == {"epoch": epoch, "start": resume_at}
        assert list(resumed) == full[epoch][resume_at:]
        assert len(resumed) == len(full[epoch])


def test_random_order_is_pure_function_of_seed_and_epoch() -> None:
    import torch

    a = RandomBatchSampler(20, 4, seed=3)
    torch.manual_seed(123)  # the global RNG does not matter
    first = epoch_stream(a, 3)
    b = RandomBatchSampler(20, 4, seed=3)
    torch.manual_seed(999)
    assert epoch_stream(b, 3) == first
    assert first[:5] != first[5:10]  # epochs differ
    assert sorted(i for batch in first[:5] for i in batch) == list(range(20))
    assert epoch_stream(RandomBatchSampler(20, 4, seed=4), 1) != first[:5]


@pytest.mark.parametrize("world", [2, 3])
def test_shards_cover_dataset_and_are_equal_length(world: int) -> None:
    n, bs = 11, 2
    shards = [RandomBatchSampler(n, bs, seed=1, num_replicas=world, rank=r) for r in range(world)]
    per_rank = [[i for b in s.epoch_batches(0) for i in b] for s in shards]
    assert len({len(s.epoch_batches(0)) for s in shards}) == 1
    assert all(len(s) == len(s.epoch_batches(0)) for s in shards)
    assert set().union(*map(set, per_rank)) == set(range(n))
    # only the wrap-around padding repeats indices
    assert sum(map(len, per_rank)) - n < world


def test_build_and_errors() -> None:
    assert isinstance(
        build_batch_sampler("sequential", range(5), 2, seed=0), SequentialBatchSampler
    )
    with pytest.raises(ValueError, match="train_sampling_strategy='nope'"):
        build_batch_sampler("nope", range(5), 2, seed=0)
    with pytest.raises(ValueError, match="rank=2"):
        RandomBatchSampler(5, 2, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="empty"):
        RandomBatchSampler(0, 2)
