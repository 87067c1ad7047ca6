"""The streaming safetensors writer and the copy-free reader (safetensors_stream, io)."""

from __future__ import annotations

import os
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load_file
from safetensors.torch import save as st_save

from trainer_runtime.checkpoint import safetensors_stream
from trainer_runtime.checkpoint import storage as storage_module
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.checkpoint.safetensors_stream import Cancelled, TensorFile
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import CheckpointError, ResumeError


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(7, 5, generator=g),
        "half": torch.randn(3, generator=g).half(),
        "bf": torch.randn(4, 2, generator=g).bfloat16(),
        "idx": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }


def test_bytes_identical_to_safetensors_for_one_dtype() -> None:
    tensors = {f"layer.{i}": torch.randn(3, i + 1) for i in range(5)}
    meta = {"format": "pt"}
    assert TensorFile(tensors, meta).to_bytes() == st_save(tensors, metadata=meta)
    assert TensorFile(tensors).to_bytes() == st_save(tensors)


def test_every_dtype_reads_back_with_safetensors(tmp_path: Path) -> None:
    tensors = _mixed()
    path = tmp_path / "x.safetensors"
    path.write_bytes(TensorFile(tensors, {"k": "v"}).to_bytes())
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    with safe_open(str(path), "pt") as fh:
        assert fh.metadata() == {"k": "v"}


def _writer(root: Path | str, step: int = 1) -> CheckpointWriter:
    w = CheckpointWriter(str(root), step)
    w.begin()
    return w


@pytest.mark.parametrize("direct_io", ["0", "1"], ids=["page cache", "O_DIRECT"])
def test_checkpoint_file_is_written_without_a_copy_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io: str
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_DIRECT_IO", direct_io)
    big = {f"t{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB
    # The measure sees a whole-file buffer: safetensors' own save builds one.
    tracemalloc.start()
    try:
        st_save(big)
        _, control_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        w = _writer(tmp_path)
        tracemalloc.reset_peak()
        w.write_tensors("model.safetensors", big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert control_peak > 32 << 20
    assert peak < 1 << 20, f"the streaming write allocated {peak} bytes"
    info = w.commit()
    assert info.complete
    reader = CheckpointReader(info.path)
    loaded, _ = reader.load_tensors_and_metadata("model.safetensors")
    reader.wait_verified()
    assert all(torch.equal(loaded[k], big[k]) for k in big)


def test_buffered_large_writes_hash_beside_writing_and_write_back_early(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the page-cache path (the default; object stores' and $PREEMPTIBLE_DIRECT_IO=0's)
    monkeypatch.setenv("PREEMPTIBLE_DIRECT_IO", "0")
    monkeypatch.setattr(storage_module, "_WRITEBACK_EVERY", 3 << 20)
    syncs: list[int] = []
    real = storage_module.os.fdatasync
    monkeypatch.setattr(storage_module.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd)))
    blocks = [bytes([i]) * (2 << 20) for i in range(6)] + [b"tail"]
    storage = Storage(str(tmp_path))
    with storage.open_write("f.bin") as fh:
        for block in blocks:
            fh.write(block)
    data = (tmp_path / "f.bin").read_bytes()
    assert data == b"".join(blocks)
    assert fh.size == len(data) and fh.digest == xxhash.xxh3_128(data).hexdigest()
    assert syncs, "writeback was never started before the final fsync"


def test_object_store_streaming_round_trip() -> None:
    url = "memory://stream-test/run"
    w = _writer(url)
    tensors = _mixed()
    w.write_tensors("model.safetensors", tensors, {"a": "b"})
    info = w.commit()
    reader = CheckpointReader(info.path)
    loaded, meta = reader.load_tensors_and_metadata("model.safetensors")
    assert meta == {"a": "b"}
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


@pytest.mark.parametrize("owned", [False, True])
def test_corruption_is_found_by_the_parallel_checksum(tmp_path: Path, owned: bool) -> None:
    w = _writer(tmp_path)
    w.write_tensors("optimizer.safetensors", {"a": torch.randn(1 << 18), "b": torch.ones(3)})
    info = w.commit()
    path = Path(info.path) / "optimizer.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # a tensor byte: the header still parses
    path.write_bytes(bytes(raw))
    reader = CheckpointReader(info.path)
    tensors, _ = reader.load_tensors_and_metadata("optimizer.safetensors", owned=owned)
    assert tensors["a"].numel() == 1 << 18
    with pytest.raises(ResumeError, match="corrupt: xxh3_128"):
        reader.wait_verified()


def test_owned_tensors_are_views_of_one_writable_buffer(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    src = _mixed()
    w.write_tensors("optimizer.safetensors", src)
    info = w.commit()
    reader = CheckpointReader(info.path)
    tensors, _ = reader.load_tensors_and_metadata("optimizer.safetensors", owned=True)
    reader.wait_verified()
    for name, t in src.items():
        assert torch.equal(tensors[name], t), name
    tensors["w"].add_(1.0)  # host memory of our own: writable, the file is untouched
    again, _ = CheckpointReader(info.path).load_tensors_and_metadata("optimizer.safetensors")
    assert torch.equal(again["w"], src["w"])


def test_cancelled_write_leaves_the_checkpoint_incomplete(tmp_path: Path) -> None:
    w = _writer(tmp_path, step=3)
    w.cancel = threading.Event()
    w.write_tensors("a.safetensors", {"x": torch.ones(4)})
    w.cancel.set()
    with pytest.raises(Cancelled):
        w.write_tensors("b.safetensors", {"x": torch.ones(4)})
    info = CheckpointStore(str(tmp_path)).inspect("checkpoint-3")
    assert not info.complete and SENTINEL_NAME in (info.reason or "")
    assert CheckpointStore(str(tmp_path)).latest_complete() is None


class _MeetingWriter(CheckpointWriter):
    """Each safetensors file waits for the other at its start: only concurrent writes meet."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.meet = threading.Barrier(2, timeout=10)

    def write_entry(self, filename: str, data: object, *, per_rank: bool = False) -> None:
        if isinstance(data, TensorFile):
            self.meet.wait()
        super().write_entry(filename, data, per_rank=per_rank)  # type: ignore[arg-type]


def test_large_files_are_written_at_the_same_time_and_records_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainer_runtime.checkpoint import io as io_module

    monkeypatch.setattr(io_module, "_PARALLEL_MIN_BYTES", 1 << 10)
    w = _MeetingWriter(str(tmp_path), 4)
    w.begin()
    model = {"w": torch.randn(64, 64)}
    optim = {"m": torch.randn(128, 64), "v": torch.randn(128, 64)}
    seen: list[list[str]] = []

    def record() -> bytes:
        seen.append(sorted(f["path"] for f in w.files))
        return b"{}"

    w.write_entries(
        [
            ("model.safetensors", TensorFile(model), False),
            ("optimizer.safetensors", TensorFile(optim, {"k": "v"}), False),
            ("state.json", record, False),
        ]
    )
    assert seen == [["model.safetensors", "optimizer.safetensors"]]
    info = w.commit()
    assert (Path(info.path) / "model.safetensors").read_bytes() == st_save(model)
    loaded = load_file(str(Path(info.path) / "optimizer.safetensors"))
    assert all(torch.equal(loaded[k], optim[k]) for k in optim)
    reader = CheckpointReader(info.path)
    reader.load_tensors_and_metadata("optimizer.safetensors", owned=True)
    reader.wait_verified()  # the manifest's checksums of both files


def test_a_file_is_read_on_two_threads_and_handed_over_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(safetensors_stream, "READ_BLOCK_BYTES", 4096)
    data = os.urandom(4096 * 9 + 123)
    path = tmp_path / "f.bin"
    path.write_bytes(b"head" + data + b"tail")
    readers: set[str] = set()
    real_preadv = os.preadv
    # Each reader thread's first read waits for the other's: with one thread only this times out
    # (on a loaded machine one thread could otherwise read every block before the second starts).
    both = threading.Barrier(2, timeout=30)

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        name = threading.current_thread().name
        if name not in readers:
            readers.add(name)
            both.wait()
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    handed: list[bytes] = []
    with open(path, "rb", buffering=0) as fh:
        fh.seek(4)
        buf = safetensors_stream.read_into_buffer(fh, len(data), lambda b: handed.append(bytes(b)))
        assert fh.tell() == 4 + len(data)  # as if read with read()
    assert bytes(buf.numpy()) == data
    assert b"".join(handed) == data and len(handed) == 10  # every block, in file order
    assert len(readers) == 2 and all(r.startswith("ckpt-read") for r in readers)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_shorter_than_its_size_is_an_error(tmp_path: Path, threads: int) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 1000)
    with (
        open(path, "rb", buffering=0) as fh,
        pytest.raises(CheckpointError, match="file ended after 1000 of 40000000 bytes"),
    ):
        safetensors_stream.read_into_buffer(fh, 40_000_000, threads=threads)
