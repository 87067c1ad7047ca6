"""Re-sharding the data position when the number of ranks changes between attempts."""

from __future__ import annotations

import pytest

from trainer_runtime.checkpoint.resharding import DataShape, reshard_position
from trainer_runtime.errors import ResumeError


@pytest.mark.parametrize(
    ("batch", "saved", "current", "expected"),
    [
        (5, (2, 8), (2, 8), 5),  # same shape: unchanged
        (4, (2, 8), (1, 8), 8),  # 64 samples consumed = 8 batches of one rank
        (4, (2, 8), (4, 8), 2),
        (6, (4, 2), (2, 4), 6),  # same global batch, different split
        (3, (2, 8), (1, 16), 3),
        (0, (2, 8), (3, 5), 0),  # an epoch boundary always carries over
    ],
)
def test_position_carries_over_when_it_divides(
    batch: int, saved: tuple[int, int], current: tuple[int, int], expected: int
) -> None:
    got = reshard_position(
        batch,
        DataShape(*saved),
        DataShape(*current),
        map_style=True,
        ignore_data_skip=False,
        path="out/checkpoint-4",
    )
    assert got == expected


def test_position_refused_naming_both_world_sizes() -> None:
    with pytest.raises(ResumeError) as err:
        reshard_position(
            3,
            DataShape(2, 8),
            DataShape(4, 8),
            map_style=True,
            ignore_data_skip=False,
            path="out/checkpoint-3",
        )
    text = str(err.value)
    assert "2 rank(s)" in text and "4 rank(s)" in text and "out/checkpoint-3" in text
    assert "ignore_data_skip=True" in text


def test_iterable_dataset_refused_unless_data_skip_ignored() -> None:
    kw = {"map_style": False, "path": "p"}
    with pytest.raises(ResumeError, match="iterable"):
        reshard_position(2, DataShape(2, 8), DataShape(1, 8), ignore_data_skip=False, **kw)
    assert reshard_position(2, DataShape(2, 8), DataShape(1, 8), ignore_data_skip=True, **kw) == 0
    assert reshard_position(2, DataShape(2, 8), DataShape(2, 8), ignore_data_skip=False, **kw) == 2


def test_ignore_data_skip_starts_the_epoch_over() -> None:
    got = reshard_position(
        3, DataShape(2, 8), DataShape(4, 8), map_style=True, ignore_data_skip=True, path="p"
    )
    assert got == 0
