"""The device-to-host checkpoint path on a real CUDA device (marker ``cuda``; skipped without).

benchmarks/gpu_check.sh runs these on a GPU machine; tests/unit/checkpoint/test_staging_ring.py
and test_snapshot_buffers.py check the same logic on the CPU.
"""

from __future__ import annotations

import gc
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load, load_file
from safetensors.torch import save as st_save

from trainer_runtime.checkpoint import staging
from trainer_runtime.checkpoint.background import BackgroundSave, SnapshotBuffers, snapshot_entry
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.safetensors_stream import Cancelled, TensorFile, write_safetensors

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

MIB = 1 << 20


def _pinned() -> int:
    gc.collect()
    return staging.held_bytes()["pinned"]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        "big.bf16": torch.randn(45 * MIB, device="cuda", generator=g).bfloat16(),  # 90 MiB
        "w.fp32": torch.randn(3000, 2001, device="cuda", generator=g),
        "strided": torch.randn(1000, 999, device="cuda", generator=g).t(),
        "mask": torch.rand(12345, device="cuda", generator=g) > 0.5,
        "idx": torch.arange(777, device="cuda"),
        "scalar": torch.tensor(3.5, device="cuda", dtype=torch.float64),
        "empty": torch.zeros(0, 3, device="cuda"),
    }


def test_cuda_tensors_reach_the_file_through_the_pinned_ring_byte_for_byte() -> None:
    tensors = _state()
    out = io.BytesIO()
    calls: list[int] = []

    def write(data: Any) -> int:
        calls.append(len(memoryview(data)))
        return out.write(data)

    write_safetensors(write, tensors, {"format": "pt"})
    host = {k: v.cpu() for k, v in tensors.items()}
    assert out.getvalue() == TensorFile(host, {"format": "pt"}).to_bytes()
    loaded = load(out.getvalue())
    assert all(torch.equal(loaded[k], v) for k, v in host.items())
    assert max(calls) == staging.BLOCK_BYTES and calls[-1] == 0  # blocks, then the release
    one = {k: v for k, v in tensors.items() if k == "big.bf16"}
    out = io.BytesIO()
    write_safetensors(out.write, one)
    assert out.getvalue() == st_save({k: v.cpu() for k, v in one.items()})
    assert staging.staging_pool.idle_bytes >= staging.BLOCK_BYTES * staging.DEPTH
    assert _pinned() >= staging.BLOCK_BYTES * staging.DEPTH  # the pooled ring is pinned


def test_copies_see_what_the_compute_stream_wrote_last() -> None:
    t = torch.zeros(64 * MIB // 4, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the compute stream busy, then the write the save must see
        a = a @ a
        a = a / a.norm()
    t.fill_(7.0)
    out = io.BytesIO()
    write_safetensors(out.write, {"t": t})
    assert torch.equal(load(out.getvalue())["t"], torch.full_like(t, 7.0).cpu())


def test_copies_see_what_another_stream_wrote_without_a_sync() -> None:
    # e.g. training on a stream of its own while the files are written by helper threads
    t = torch.zeros(64 * MIB // 4, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    other = torch.cuda.Stream()
    other.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(other):
        for _ in range(20):
            a = a @ a
            a = a / a.norm()
        t.fill_(5.0)
    out = io.BytesIO()
    write_safetensors(out.write, {"t": t})
    assert torch.equal(load(out.getvalue())["t"], torch.full_like(t, 5.0).cpu())


def _torch_pinned() -> int | None:
    """Bytes held by torch's caching host allocator, where this torch reports them."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    for key in ("allocated_bytes.current", "allocated_bytes.all.current"):
        if key in stats:
            return int(stats[key])
    return None


def test_pinned_host_buffers_are_exact_size_and_unpinned_once_unused() -> None:
    before, torch_before = _pinned(), _torch_pinned()
    buf = staging.host_buffer(172 * MIB, pin=True)
    assert buf.is_pinned()
    assert _pinned() - before == 172 * MIB  # not 256 MiB
    assert _torch_pinned() == torch_before  # not from torch's caching pool
    buf.fill_(1)
    del buf
    assert _pinned() == before


def test_a_cuda_snapshot_is_pinned_and_given_back_after_its_write(tmp_path: Path) -> None:
    tensors = _state()
    before = _pinned()
    buffers = SnapshotBuffers()  # the default: given back once written
    entry = snapshot_entry("model.safetensors", TensorFile(tensors), buffers)
    snap = entry.tensors
    assert all(v.device.type == "cpu" for v in snap.values())
    assert all(snap[k].is_pinned() for k in tensors if tensors[k].numel())
    assert all(torch.equal(snap[k], v.cpu()) for k, v in tensors.items())
    nbytes = sum(-(-(v.numel() * v.element_size()) // 4096) * 4096 for v in tensors.values())
    assert _pinned() - before == nbytes == buffers.held_bytes
    del snap
    writer = CheckpointWriter(str(tmp_path), 1)
    job = BackgroundSave(writer, [("model.safetensors", entry, False)], begin=True)
    del entry
    job.wait()
    assert job.error is None
    writer.commit()
    assert _pinned() == before and buffers.held_bytes == 0
    loaded = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    assert all(torch.equal(loaded[k], v.cpu()) for k, v in tensors.items())


def test_keep_holds_the_pinned_snapshot_between_saves() -> None:
    tensors = _state()
    buffers = SnapshotBuffers(keep=True)
    first = buffers.snapshot("model.safetensors", tensors)["big.bf16"].data_ptr()
    held = buffers.held_bytes
    gc.collect()
    assert buffers.held_bytes == held > 0
    assert buffers.snapshot("model.safetensors", tensors)["big.bf16"].data_ptr() == first
    buffers.clear()
    gc.collect()
    assert buffers.held_bytes == 0


def test_checkpoint_files_from_cuda_round_trip_with_their_checksums(tmp_path: Path) -> None:
    tensors = _state()
    writer = CheckpointWriter(str(tmp_path), 3)
    writer.begin()
    writer.write_tensors("model.safetensors", tensors)
    info = writer.commit()
    assert info.complete
    reader = CheckpointReader(info.path)
    loaded, _ = reader.load_tensors_and_metadata("model.safetensors", owned=True)
    reader.wait_verified()  # the manifest's checksum, computed from the ring's blocks
    assert all(torch.equal(loaded[k], v.cpu()) for k, v in tensors.items())


def test_a_cancelled_write_from_cuda_stops_between_blocks_and_the_next_save_works() -> None:
    tensors = _state()
    cancel = threading.Event()
    calls = [0]

    def write(data: Any) -> int:
        calls[0] += 1
        if calls[0] == 3:
            cancel.set()
        return len(memoryview(data))

    with pytest.raises(Cancelled):
        write_safetensors(write, tensors, cancel=cancel)
    assert calls[0] == 3
    out = io.BytesIO()
    write_safetensors(out.write, tensors)
    assert out.getvalue() == TensorFile({k: v.cpu() for k, v in tensors.items()}).to_bytes()
