"""A cold optimizer file read with O_DIRECT straight into its (aligned) buffer (issue 38.5).

``direct_read.open_direct`` gives an ``O_DIRECT`` descriptor only for a file mostly not in the
page cache, where direct reads are on and the filesystem takes the flag; ``read_into_buffer``
reads each block's whole pages through it and the rest (a partial last page, everything after a
refused request) through the page cache. The bytes, the blocks the checksum sees, and the
refusal of a corrupt or resized file are the same as through the page cache.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from trainer_runtime.checkpoint import direct_read, io, safetensors_stream
from trainer_runtime.checkpoint.direct_read import (
    aligned_empty,
    open_direct,
    resident_fraction,
)
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.model_state import OPTIMIZER_NAME
from trainer_runtime.checkpoint.safetensors_stream import READ_BLOCK_BYTES, read_into_buffer
from trainer_runtime.errors import ResumeError
from trainer_runtime.testing import drop_from_page_cache

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT here")


def _file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    g = torch.Generator().manual_seed(size)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    drop_from_page_cache(path)
    return path, data


class _Preads:
    """os.preadv in safetensors_stream, counting the bytes read through each descriptor."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse_fd: int | None = None) -> None:
        self.bytes: dict[int, int] = {}
        self.refused = 0
        real = os.preadv

        def preadv(fd: int, buffers: list, offset: int) -> int:
            if fd == refuse_fd:
                self.refused += 1
                raise OSError(errno.EINVAL, "refused")
            n = real(fd, buffers, offset)
            self.bytes[fd] = self.bytes.get(fd, 0) + n
            return n

        monkeypatch.setattr(safetensors_stream.os, "preadv", preadv)


@pytest.mark.parametrize("size", [4096, 4097, 12345, READ_BLOCK_BYTES + 4096 * 3 + 17])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_cold_file_is_read_through_o_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, threads: int
) -> None:
    path, data = _file(tmp_path, size)
    fd = open_direct(str(path), size)
    assert fd is not None, "a cold file on this filesystem gets O_DIRECT"
    reads = _Preads(monkeypatch)
    seen = bytearray()
    try:
        with open(path, "rb", buffering=0) as fh:
            out = aligned_empty(size)
            buf = read_into_buffer(fh, size, seen.extend, out=out, threads=threads, direct_fd=fd)
    finally:
        os.close(fd)
    assert buf is out and bytes(buf.numpy()) == data and bytes(seen) == data
    assert reads.bytes.get(fd, 0) == size // 4096 * 4096  # every whole page, direct


def test_a_refused_direct_request_goes_on_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 2 * READ_BLOCK_BYTES + 100
    path, data = _file(tmp_path, size)
    fd = open_direct(str(path), size)
    assert fd is not None
    reads = _Preads(monkeypatch, refuse_fd=fd)
    seen = bytearray()
    try:
        with open(path, "rb", buffering=0) as fh:
            out = aligned_empty(size)
            buf = read_into_buffer(fh, size, seen.extend, out=out, threads=1, direct_fd=fd)
    finally:
        os.close(fd)
    assert bytes(buf.numpy()) == data and bytes(seen) == data
    assert reads.refused == 1  # refused once, never asked again


def test_an_unaligned_buffer_is_read_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = 3 * 4096
    path, data = _file(tmp_path, size)
    fd = open_direct(str(path), size)
    assert fd is not None
    reads = _Preads(monkeypatch)
    out = aligned_empty(size + 1)[1:]  # one byte off the page
    try:
        with open(path, "rb", buffering=0) as fh:
            read_into_buffer(fh, size, out=out, direct_fd=fd)
    finally:
        os.close(fd)
    assert bytes(out.numpy()) == data and fd not in reads.bytes


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 5 << 20])
def test_aligned_empty(size: int) -> None:
    buf = aligned_empty(size)
    assert buf.numel() == size and buf.dtype == torch.uint8 and buf.is_contiguous()
    assert buf.data_ptr() % 4096 == 0


def test_residency_decides(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * (1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        path.read_bytes()
        assert resident_fraction(fd, 1 << 20) == 1.0
        drop_from_page_cache(path)
        assert resident_fraction(fd, 1 << 20) == 0.0
    finally:
        os.close(fd)
    path.read_bytes()  # warm: read through the page cache, which already holds it
    assert open_direct(str(path), 1 << 20) is None
    drop_from_page_cache(path)
    fd2 = open_direct(str(path), 1 << 20)
    assert fd2 is not None
    os.close(fd2)


@pytest.mark.parametrize("windows", [2, 3, 64])
def test_a_large_file_is_sampled(tmp_path: Path, windows: int) -> None:
    """Sampled in windows: the first half cold, the second warm reads as about half."""
    size = 64 * 4096
    path = tmp_path / "f"
    path.write_bytes(b"y" * size)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, size // 2, size // 2)  # the second half back in the page cache
        whole = resident_fraction(fd, size)
        sampled = resident_fraction(fd, size, windows=windows, window=4096)
    finally:
        os.close(fd)
    assert whole is not None and 0.4 <= whole <= 0.6
    assert sampled is not None and 0.3 <= sampled <= 0.7
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert resident_fraction(fd, size, windows=windows, window=4096) == 0.0
    finally:
        os.close(fd)


@pytest.mark.parametrize(("value", "direct"), [("0", False), ("1", True), ("", True)])
def test_the_switch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, direct: bool
) -> None:
    monkeypatch.setenv(direct_read.ENV, value)
    path, _ = _file(tmp_path, 1 << 16)
    fd = open_direct(str(path), 1 << 16)
    assert (fd is not None) is direct
    if fd is not None:
        os.close(fd)


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EOPNOTSUPP])
def test_a_filesystem_without_o_direct_gets_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path, _ = _file(tmp_path, 1 << 16)
    real = os.open

    def refusing(p: str, flags: int, *a: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(code, "no O_DIRECT")
        return real(p, flags, *a)

    monkeypatch.setattr(direct_read.os, "open", refusing)
    assert open_direct(str(path), 1 << 16) is None


def test_a_fuse_mount_gets_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = _file(tmp_path, 1 << 16)
    monkeypatch.setattr(direct_read, "filesystem_magic", lambda p: direct_read.FUSE_SUPER_MAGIC)
    assert open_direct(str(path), 1 << 16) is None


def test_the_tmpfs_fallback_reads_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm (tmpfs): whatever it answers to O_DIRECT, the reader gets the file's bytes."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = Path("/dev/shm") / f"direct-read-{os.getpid()}"
    data = os.urandom(3 * 4096 + 5)
    path.write_bytes(data)
    try:
        fd = open_direct(str(path), len(data))
        with open(path, "rb", buffering=0) as fh:
            out = aligned_empty(len(data))
            read_into_buffer(fh, len(data), out=out, direct_fd=fd)
        if fd is not None:
            os.close(fd)
        assert bytes(out.numpy()) == data
    finally:
        path.unlink()


# -- the reader -----------------------------------------------------------------------------------


def _checkpoint(tmp_path: Path) -> tuple[str, Path]:
    g = torch.Generator().manual_seed(5)
    state = {
        "state": {
            i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(257, 9, generator=g)}
            for i in range(4)
        },
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}],
    }
    w = CheckpointWriter(str(tmp_path), 1)
    w.begin()
    w.write_optimizer_state(OPTIMIZER_NAME, state)
    path = w.commit().path
    file = Path(path) / OPTIMIZER_NAME
    drop_from_page_cache(file)
    return path, file


def _spy_open_direct(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    got: list[int | None] = []

    def spy(path: str, size: int) -> int | None:
        fd = open_direct(path, size)
        got.append(fd)
        return fd

    monkeypatch.setattr(io, "open_direct", spy)
    return got


@pytest.mark.parametrize("prepare", [True, False])
def test_the_reader_reads_a_cold_optimizer_file_directly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prepare: bool
) -> None:
    path, file = _checkpoint(tmp_path)
    expected = CheckpointReader(path, verify=False)
    drop_from_page_cache(file)
    got = _spy_open_direct(monkeypatch)
    reader = CheckpointReader(path)
    if prepare:
        reader.prepare_owned(OPTIMIZER_NAME)
        assert reader._prepared[OPTIMIZER_NAME].data_ptr() % 4096 == 0
    state = reader.load_optimizer()
    reader.wait_verified()
    assert got and got[0] is not None, "the cold file was opened with O_DIRECT"
    drop_from_page_cache(file)
    want = expected.load_optimizer()
    assert state is not None and want is not None
    for pid, entry in want["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, state["state"][pid][key])


def test_a_corrupt_cold_optimizer_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, file = _checkpoint(tmp_path)
    raw = bytearray(file.read_bytes())
    raw[-5] ^= 0x40
    file.write_bytes(bytes(raw))
    drop_from_page_cache(file)
    got = _spy_open_direct(monkeypatch)
    reader = CheckpointReader(path)
    reader.prepare_owned(OPTIMIZER_NAME)
    reader.load_optimizer()
    assert got and got[0] is not None
    with pytest.raises(ResumeError, match="corrupt"):
        reader.wait_verified()


@pytest.mark.parametrize("change", [-100, 64])
def test_a_resized_cold_optimizer_file_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: int
) -> None:
    path, file = _checkpoint(tmp_path)
    reader = CheckpointReader(path)
    reader.prepare_owned(OPTIMIZER_NAME)
    raw = file.read_bytes()
    file.write_bytes(raw[:change] if change < 0 else raw + b"\0" * change)
    drop_from_page_cache(file)
    got = _spy_open_direct(monkeypatch)
    with pytest.raises(ResumeError):
        reader.load_optimizer()
        reader.wait_verified()
    assert got and got[0] is not None
