"""Local checkpoint files written around the page cache (direct_io) and through Storage."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import xxhash

from trainer_runtime.checkpoint import direct_io
from trainer_runtime.checkpoint.direct_io import ALIGN, DirectFile
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import StorageError

pytestmark = pytest.mark.skipif(not direct_io.direct_io_supported(), reason="no O_DIRECT here")


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    """1 MiB staging blocks: several blocks and a wrap-around of the ring with small files."""
    monkeypatch.setattr(direct_io, "BLOCK_BYTES", 1 << 20)
    return 1 << 20


def _payload(size: int) -> bytes:
    return hashlib.shake_256(b"checkpoint").digest(size)


def _write_and_check(tmp_path: Path, size: int) -> DirectFile:
    """Write ``size`` bytes in one call; the file and its checksum hold exactly them."""
    data = _payload(size)
    f = DirectFile(str(tmp_path / "f.bin"))
    f.write(data)
    f.close()
    assert (tmp_path / "f.bin").read_bytes() == data
    assert f.digest == xxhash.xxh3_128(data).hexdigest()
    return f


def _needs_direct(tmp_path: Path) -> None:
    probe = DirectFile(str(tmp_path / "probe"))
    probe.close()
    if not probe.direct_bytes and not probe.direct:
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT")


@pytest.mark.parametrize(
    "pieces",
    [
        [7],  # a file smaller than a sector: all tail
        [ALIGN * 3],  # whole sectors, no tail
        [3 << 20, 5, (1 << 20) + 17, 1 << 20],  # blocks of the ring reused, unaligned tail
        [(1 << 20) * 9 + 123],  # one call spanning more blocks than the ring has
    ],
)
def test_bytes_size_and_digest_match_what_was_written(
    tmp_path: Path, small_blocks: int, pieces: list[int]
) -> None:
    data = _payload(sum(pieces))
    path = tmp_path / "f.bin"
    f = DirectFile(str(path))
    at = 0
    for n in pieces:
        f.write(memoryview(data)[at : at + n])
        at += n
    f.close()
    assert path.read_bytes() == data
    assert f.size == len(data) and f.digest == xxhash.xxh3_128(data).hexdigest()


def test_whole_sectors_go_around_the_page_cache(tmp_path: Path, small_blocks: int) -> None:
    _needs_direct(tmp_path)
    size = 5 * small_blocks + 3 * ALIGN + 100
    f = DirectFile(str(tmp_path / "f.bin"))
    f.write(_payload(size))
    f.close()
    # every whole sector with O_DIRECT, only the last partial sector through the page cache
    assert f.direct_bytes == size - 100


def test_both_writer_threads_fall_back_when_direct_requests_are_refused(
    tmp_path: Path, small_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests refused at the same time: the one whose thread finds O_DIRECT already
    cleared by the other retries through the page cache instead of failing the save."""
    assert direct_io.IO_THREADS >= 2
    real = os.pwrite
    both_in_flight = threading.Barrier(2, timeout=10)
    lock = threading.Lock()
    refused: list[int] = []

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            with lock:
                refused.append(offset)
                nth = len(refused)
            if nth <= 2:
                both_in_flight.wait()  # two requests issued with O_DIRECT, both in flight
            if nth == 2:
                # the second is refused only after the first one's thread cleared O_DIRECT
                for _ in range(5000):
                    if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                        break
                    time.sleep(0.001)
                time.sleep(0.05)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refusing)
    f = _write_and_check(tmp_path, 6 * small_blocks + 999)
    assert len(refused) == 2 and not f.direct


def test_a_pooled_block_still_viewed_elsewhere_never_fails_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block of another size that cannot be unmapped yet (a slice of it lives on, e.g. in a
    failed write's traceback) is dropped from the pool, not an error for the next file."""
    pool = direct_io._StagingPool()
    monkeypatch.setattr(direct_io, "staging_pool", pool)
    monkeypatch.setattr(direct_io, "BLOCK_BYTES", 1 << 20)
    old = pool.take()
    held = memoryview(old)[:10]  # an export: old.close() raises BufferError
    pool.give([old])
    monkeypatch.setattr(direct_io, "BLOCK_BYTES", 2 << 20)
    f = _write_and_check(tmp_path, 3 * (2 << 20) + 5)
    assert all(len(b) == 2 << 20 for b in pool._free) and f.size == 3 * (2 << 20) + 5
    held.release()


def test_callers_buffer_may_change_after_write(tmp_path: Path, small_blocks: int) -> None:
    buf = bytearray(_payload(3 * small_blocks))
    expected = bytes(buf)
    f = DirectFile(str(tmp_path / "f.bin"))
    f.write(buf)
    buf[:] = bytes(len(buf))  # the blocks are staged copies: the file keeps the old bytes
    f.close()
    assert (tmp_path / "f.bin").read_bytes() == expected


def test_a_filesystem_refusing_direct_requests_gets_buffered_writes(
    tmp_path: Path, small_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Some filesystems accept O_DIRECT at open and refuse the requests (EINVAL).
    real = os.pwrite

    def refusing(fd: int, data: memoryview, offset: int) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", refusing)
    f = _write_and_check(tmp_path, 4 * small_blocks + 999)
    assert f.direct_bytes == 0 and not f.direct


def test_staging_blocks_are_reused_between_files(tmp_path: Path, small_blocks: int) -> None:
    direct_io.staging_pool.warm(direct_io.DEPTH)
    before = list(direct_io.staging_pool._free)
    for i in range(2):
        f = DirectFile(str(tmp_path / f"f{i}.bin"))
        f.write(_payload(6 * small_blocks))
        f.close()
    after = direct_io.staging_pool._free
    assert sorted(map(id, after)) == sorted(map(id, before))


def test_storage_writes_local_files_directly_and_names_errors(
    tmp_path: Path, small_blocks: int
) -> None:
    storage = Storage(str(tmp_path))
    data = _payload(2 * small_blocks + 5)
    with storage.open_write("sub/f.bin") as fh:
        fh.write(data)
    assert (tmp_path / "sub" / "f.bin").read_bytes() == data
    assert (fh.size, fh.digest) == (len(data), xxhash.xxh3_128(data).hexdigest())


@pytest.mark.parametrize("size_blocks", [0, 5])  # the error at close / from a block's write
def test_a_failed_write_is_a_storage_error_naming_the_file(
    tmp_path: Path, small_blocks: int, monkeypatch: pytest.MonkeyPatch, size_blocks: int
) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_io.os, "pwrite", full)
    storage = Storage(str(tmp_path))
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StorageError) as info, storage.open_write("f.bin") as fh:
        fh.write(_payload(size_blocks * small_blocks + 10))
    assert info.value.errno == errno.ENOSPC and info.value.url == f"{tmp_path}/f.bin"
    assert len(os.listdir("/proc/self/fd")) == fds  # the file was closed
