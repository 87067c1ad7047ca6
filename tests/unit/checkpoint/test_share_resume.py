"""Which rank reads which shard of a rank-shared (DDP) checkpoint on resume (issue 38)."""

from __future__ import annotations

import pytest

from trainer_runtime.checkpoint.share_resume import reading_owners


def _names(stem: str, count: int) -> list[str]:
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _maps(count: int) -> list[dict[str, str]]:
    return [
        {f"w{i}": name for i, name in enumerate(_names("model", count))},
        {f"s{i}": name for i, name in enumerate(_names("optimizer", count))},
    ]


@pytest.mark.parametrize(
    ("count", "sizes", "saved", "world", "expected"),
    [
        # the save's world size: each rank reads the shards it wrote, whatever their sizes
        (
            2,
            {"model-00001-of-00002.safetensors": 10, "optimizer-00002-of-00002.safetensors": 90},
            2,
            2,
            {
                "model-00001-of-00002.safetensors": 0,
                "model-00002-of-00002.safetensors": 1,
                "optimizer-00001-of-00002.safetensors": 0,
                "optimizer-00002-of-00002.safetensors": 1,
            },
        ),
        # another world size: whole files by bytes, largest first to the least loaded rank
        (
            2,
            {
                "model-00001-of-00002.safetensors": 10,
                "model-00002-of-00002.safetensors": 10,
                "optimizer-00001-of-00002.safetensors": 20,
                "optimizer-00002-of-00002.safetensors": 20,
            },
            2,
            3,
            {
                "optimizer-00001-of-00002.safetensors": 0,
                "optimizer-00002-of-00002.safetensors": 1,
                "model-00001-of-00002.safetensors": 2,
                "model-00002-of-00002.safetensors": 2,
            },
        ),
        # the save's world size, but a group with fewer shards than ranks: split by bytes
        (
            1,
            {"model-00001-of-00001.safetensors": 5, "optimizer-00001-of-00001.safetensors": 7},
            2,
            2,
            {"optimizer-00001-of-00001.safetensors": 0, "model-00001-of-00001.safetensors": 1},
        ),
        # unknown world size of the save (an old manifest): split by bytes
        (
            2,
            {name: 1 for m in _maps(2) for name in m.values()},
            None,
            2,
            {
                "model-00001-of-00002.safetensors": 0,
                "model-00002-of-00002.safetensors": 1,
                "optimizer-00001-of-00002.safetensors": 0,
                "optimizer-00002-of-00002.safetensors": 1,
            },
        ),
    ],
)
def test_reading_owners(
    count: int,
    sizes: dict[str, int],
    saved: int | None,
    world: int,
    expected: dict[str, int],
) -> None:
    assert reading_owners(_maps(count), sizes, saved, world) == expected
