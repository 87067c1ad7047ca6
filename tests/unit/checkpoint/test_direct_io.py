"""Local checkpoint files written around the page cache (direct_io) and through Storage.

O_DIRECT is opt-in (checkpoint_direct_io, $PREEMPTIBLE_DIRECT_IO): off by default, never on FUSE,
and a filesystem refusing it (or an out-of-order write) gets buffered writes in order."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash

from trainer_runtime.checkpoint import direct_io
from trainer_runtime.checkpoint import storage as storage_module
from trainer_runtime.checkpoint.direct_io import ALIGN, DirectFile
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.storage import HashingWriter, Storage, configure_direct_io
from trainer_runtime.errors import StorageError

pytestmark = pytest.mark.skipif(not direct_io.direct_io_supported(), reason="no O_DIRECT here")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with O_DIRECT not asked for and no filesystem remembered as refusing."""
    monkeypatch.delenv("PREEMPTIBLE_DIRECT_IO", raising=False)
    monkeypatch.setattr(storage_module, "_direct_io_asked", False)
    monkeypatch.setattr(direct_io, "_refusing_devices", set())
    monkeypatch.setattr(direct_io, "_logged", set())


@pytest.fixture
def direct_on() -> None:
    """The opt-in (TrainingArguments.checkpoint_direct_io=True); reset by _isolated."""
    configure_direct_io(True)


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every os.open of the test: (path, flags)."""
    seen: list[tuple[str, int]] = []
    real = os.open

    def spy(path: str, flags: int, *args: int, **kwargs: int) -> int:
        seen.append((str(path), flags))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(direct_io.os, "open", spy)
    return seen


def _direct_opens(opens: list[tuple[str, int]]) -> list[str]:
    return [path for path, flags in opens if flags & os.O_DIRECT]


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
    tmp_path: Path, small_blocks: int, direct_on: None
) -> None:
    storage = Storage(str(tmp_path))
    data = _payload(2 * small_blocks + 5)
    with storage.open_write("sub/f.bin") as fh:
        fh.write(data)
    assert (tmp_path / "sub" / "f.bin").read_bytes() == data
    assert (fh.size, fh.digest) == (len(data), xxhash.xxh3_128(data).hexdigest())


@pytest.mark.parametrize("size_blocks", [0, 5])  # the error at close / from a block's write
def test_a_failed_write_is_a_storage_error_naming_the_file(
    tmp_path: Path,
    small_blocks: int,
    monkeypatch: pytest.MonkeyPatch,
    size_blocks: int,
    direct_on: None,
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


# -- opt-in only -------------------------------------------------------------------------------
def test_local_writes_go_through_the_page_cache_by_default(
    tmp_path: Path, opens: list[tuple[str, int]]
) -> None:
    storage = Storage(str(tmp_path))
    assert not storage.writes_direct
    data = _payload(3 << 20)
    with storage.open_write("f.bin") as fh:
        fh.write(data)
    assert isinstance(fh, HashingWriter)  # no staging copies
    assert _direct_opens(opens) == []
    assert (tmp_path / "f.bin").read_bytes() == data


@pytest.mark.parametrize(
    ("asked", "env", "direct"),
    [
        (True, None, True),  # TrainingArguments.checkpoint_direct_io=True
        (False, "1", True),  # $PREEMPTIBLE_DIRECT_IO=1 turns it on
        (True, "0", False),  # $PREEMPTIBLE_DIRECT_IO=0 wins over the field
        (False, None, False),
    ],
)
def test_direct_writes_only_where_asked_for(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    opens: list[tuple[str, int]],
    asked: bool,
    env: str | None,
    direct: bool,
) -> None:
    _needs_direct(tmp_path)
    opens.clear()
    configure_direct_io(asked)
    if env is not None:
        monkeypatch.setenv("PREEMPTIBLE_DIRECT_IO", env)
    storage = Storage(str(tmp_path / "out"))
    assert storage.writes_direct is direct
    with storage.open_write("f.bin") as fh:
        fh.write(_payload(1 << 20))
    assert _direct_opens(opens) == ([f"{tmp_path}/out/f.bin"] if direct else [])


def test_filesystem_magic_is_statfs_f_type(tmp_path: Path) -> None:
    assert direct_io.filesystem_magic("/proc") == 0x9FA0  # PROC_SUPER_MAGIC
    # a directory not created yet: its nearest existing ancestor's filesystem
    assert direct_io.filesystem_magic(str(tmp_path / "a" / "b")) == direct_io.filesystem_magic(
        str(tmp_path)
    )


def test_fuse_mounts_never_get_direct_writes_and_are_written_in_order(
    tmp_path: Path,
    small_blocks: int,
    monkeypatch: pytest.MonkeyPatch,
    opens: list[tuple[str, int]],
    direct_on: None,
) -> None:
    monkeypatch.setattr(direct_io, "filesystem_magic", lambda path: direct_io.FUSE_SUPER_MAGIC)
    storage = Storage(str(tmp_path))
    assert not storage.writes_direct
    with storage.open_write("via-storage.bin") as fh:
        fh.write(_payload(3 * small_blocks))
    assert isinstance(fh, HashingWriter)  # buffered, written by the caller's thread, in order
    offsets: list[int] = []
    real = os.pwrite

    def recording(fd: int, data: memoryview, offset: int) -> int:
        offsets.append(offset)
        time.sleep(0.002 if len(offsets) % 2 else 0)  # out of order, were two in flight
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io.os, "pwrite", recording)
    f = _write_and_check(tmp_path, 6 * small_blocks + 999)  # DirectFile asked for direct
    assert not f.direct and f.sequential and f.direct_bytes == 0
    assert offsets == sorted(offsets) and len(offsets) >= 6
    assert _direct_opens(opens) == []


class _SequentialOnly:
    """pwrite of a filesystem that accepts O_DIRECT but refuses a write that does not start
    where the file ends (EINVAL), as sequential-only filesystems do; a file's first block is
    slow, so the second writer thread's block arrives first."""

    def __init__(self) -> None:
        self.ends: dict[int, int] = {}  # by inode
        self.refused: list[int] = []
        self.done: list[int] = []
        self.lock = threading.Lock()
        self.real = os.pwrite

    def __call__(self, fd: int, data: memoryview, offset: int) -> int:
        if offset == 0:
            time.sleep(0.2)
        inode = os.fstat(fd).st_ino
        with self.lock:
            if offset != self.ends.get(inode, 0):
                self.refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            n = self.real(fd, data, offset)
            self.ends[inode] = offset + n
            self.done.append(offset)
            return n


def test_an_out_of_order_refusal_is_written_again_in_order(
    tmp_path: Path, small_blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = _SequentialOnly()
    monkeypatch.setattr(direct_io.os, "pwrite", fs)
    f = _write_and_check(tmp_path, 6 * small_blocks + 999)
    assert fs.refused and f.refused is not None and f.sequential and not f.direct
    assert fs.done == sorted(fs.done)
    # the filesystem is remembered: the next file there is not staged at all
    assert not direct_io.usable_at(str(tmp_path))


@pytest.mark.parametrize("where", ["open", "write"])
def test_a_refused_save_falls_back_and_the_checkpoint_verifies(
    tmp_path: Path,
    small_blocks: int,
    monkeypatch: pytest.MonkeyPatch,
    opens: list[tuple[str, int]],
    direct_on: None,
    where: str,
) -> None:
    if where == "open":  # O_DIRECT refused at open (EOPNOTSUPP)
        spy = direct_io.os.open

        def refusing_open(path: str, flags: int, *args: int) -> int:
            if flags & os.O_DIRECT:
                opens.append((str(path), flags))
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            return spy(path, flags, *args)

        monkeypatch.setattr(direct_io.os, "open", refusing_open)
    else:  # accepted at open, an out-of-order write refused (EINVAL)
        fs = _SequentialOnly()
        monkeypatch.setattr(direct_io.os, "pwrite", fs)
    g = torch.Generator().manual_seed(1)
    model = {f"w{i}": torch.randn(1 << 19, generator=g) for i in range(6)}  # 12 MiB
    optim = {f"m{i}": torch.randn(1 << 18, generator=g) for i in range(4)}
    writer = CheckpointWriter(str(tmp_path / "out"), 1)
    writer.begin()
    writer.write_tensors("model.safetensors", model)
    writer.write_tensors("optimizer.safetensors", optim)
    writer.write_json("trainer_state.json", {"global_step": 1})
    info = writer.commit()
    assert info.complete
    if where == "write":
        assert fs.refused and fs.done == sorted(fs.done)
    reader = CheckpointReader(info.path)
    loaded, _ = reader.load_tensors_and_metadata("model.safetensors")
    loaded_optim, _ = reader.load_tensors_and_metadata("optimizer.safetensors")
    reader.wait_verified()  # every file's checksum matches what was written
    assert all(torch.equal(loaded[k], model[k]) for k in model)
    assert all(torch.equal(loaded_optim[k], optim[k]) for k in optim)
    # once refused, the rest of the save goes through the page cache
    tried = [os.path.basename(p) for p in _direct_opens(opens)]
    assert tried and "optimizer.safetensors" not in tried and "trainer_state.json" not in tried


def test_default_block_size_round_trips_with_every_block_of_the_ring_reused(
    tmp_path: Path,
) -> None:
    """The staging blocks as shipped (issue 38.5: fewer, larger requests): a file of more blocks
    than the ring holds, in pieces that straddle blocks, with an unaligned tail; every byte
    lands, the aligned part around the page cache, the checksum of exactly those bytes."""
    _needs_direct(tmp_path)
    block = direct_io.BLOCK_BYTES
    assert block % ALIGN == 0 and block >= 16 << 20
    size = block * (direct_io.DEPTH + 1) + block // 3 + 4095
    data = _payload(size)
    f = DirectFile(str(tmp_path / "f.bin"))
    for lo in range(0, size, block // 2 + 1):  # pieces that straddle the blocks
        f.write(data[lo : lo + block // 2 + 1])
    f.close()
    assert (tmp_path / "f.bin").read_bytes() == data
    assert f.digest == xxhash.xxh3_128(data).hexdigest()
    assert f.direct_bytes == size - size % ALIGN
