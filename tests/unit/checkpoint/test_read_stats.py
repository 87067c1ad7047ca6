"""The storage seam counts every byte it reads: whole files, streamed handles, ranges."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_runtime.checkpoint import read_stats
from trainer_runtime.checkpoint.storage import Storage


@pytest.fixture
def store(tmp_path: Path) -> Storage:
    (tmp_path / "f.bin").write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    return Storage(str(tmp_path))


def _ranged(store: Storage) -> bytes:
    buf = bytearray(100)
    store.read_range("f.bin", 1000, memoryview(buf))
    return bytes(buf)


def _streamed(store: Storage) -> bytes:
    with store.open_read("f.bin") as fh:
        fh.seek(10)
        return fh.read(50)


@pytest.mark.parametrize(
    ("read", "expected", "counted"),
    [
        (lambda s: s.read_bytes("f.bin"), (bytes(range(256)) * 40), 10240),
        (_ranged, (bytes(range(256)) * 40)[1000:1100], 100),
        (_streamed, (bytes(range(256)) * 40)[10:60], 50),
        (lambda s: s.hash_file("f.bin")[0], 10240, 10240),
    ],
    ids=["whole", "range", "stream", "hash"],
)
def test_each_read_is_counted_by_the_bytes_it_returned(
    store: Storage, read: object, expected: object, counted: int
) -> None:
    read_stats.reset()
    assert read(store) == expected  # type: ignore[operator]
    assert read_stats.bytes_read() == counted


def test_memory_store_ranges_are_counted_too() -> None:
    store = Storage("memory://read-stats-test")
    store.write_bytes("f.bin", b"0123456789")
    read_stats.reset()
    buf = bytearray(4)
    store.read_range("f.bin", 3, memoryview(buf))
    assert bytes(buf) == b"3456" and read_stats.bytes_read() == 4
