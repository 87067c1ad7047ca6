"""Host memory of background-save snapshots (checkpoint/background.py, SnapshotBuffers).

Real writers and real BackgroundSave threads. A snapshot's memory is counted while any tensor
uses it (``held_bytes`` drops when the buffer itself is freed, not when a Python name goes).
tests/gpu checks the pinned buffers of CUDA snapshots.
"""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.checkpoint import _enospc_fs
from trainer_runtime.checkpoint.background import BackgroundSave, SnapshotBuffers, snapshot_entry
from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.safetensors_stream import TensorFile
from trainer_runtime.errors import StorageError


def _state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    model = {
        "a.weight": torch.randn(300, 257, generator=g),
        "a.bias": torch.randn(257, generator=g).bfloat16(),
        "mask": torch.rand(77, generator=g) > 0.5,
        "strided": torch.randn(64, 48, generator=g).t(),
        "empty": torch.zeros(0, 3),
    }
    optim = {f"state.{i}.exp_avg": torch.randn(100_000, generator=g) for i in range(3)}
    return model, optim


def test_a_snapshot_holds_exactly_its_tensors_and_no_longer_follows_them() -> None:
    model, _ = _state()
    buffers = SnapshotBuffers()
    snap = buffers.snapshot("model.safetensors", model)
    for name, t in model.items():
        assert snap[name].dtype == t.dtype and snap[name].shape == t.shape
        assert torch.equal(snap[name], t) and snap[name].device.type == "cpu"
        assert snap[name].is_contiguous()
    # exact sizes (CPU tensors: one block each from torch's allocator; tests/gpu checks the
    # pinned mapping of a CUDA snapshot)
    assert buffers.held_bytes == sum(t.numel() * t.element_size() for t in model.values())
    # a snapshot: training may change the originals at once
    for t in model.values():
        t.zero_() if t.dtype != torch.bool else t.logical_not_()
    assert not torch.equal(snap["a.weight"], model["a.weight"])
    assert not torch.equal(snap["mask"], model["mask"])
    del snap
    gc.collect()
    assert buffers.held_bytes == 0


def _background(root: Path | str, step: int, buffers: SnapshotBuffers, **kw: Any) -> BackgroundSave:
    model, optim = _state()
    writer = CheckpointWriter(str(root), step, **kw)
    entries = [
        ("model.safetensors", TensorFile(model, {"format": "pt"}), False),
        ("optimizer.safetensors", TensorFile(optim), False),
    ]
    entries = [(n, snapshot_entry(n, d, buffers), r) for n, d, r in entries]
    return BackgroundSave(writer, entries, begin=True)


def test_the_snapshot_memory_goes_back_once_the_files_are_written(tmp_path: Path) -> None:
    buffers = SnapshotBuffers()  # the default: keep=False
    save = _background(tmp_path, 1, buffers)
    assert buffers.held_bytes > 1_200_000  # model + optimizer state, while the write runs
    save.wait()
    assert save.error is None and not save.cancelled
    gc.collect()
    assert buffers.held_bytes == 0  # freed: the write dropped the last view
    info = save.writer.commit()
    assert info.complete
    model, optim = _state()
    loaded = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in model.items())
    loaded = load_file(str(tmp_path / "checkpoint-1" / "optimizer.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in optim.items())


def test_keep_reuses_the_same_memory_between_saves(tmp_path: Path) -> None:
    buffers = SnapshotBuffers(keep=True)
    first = _background(tmp_path, 1, buffers)
    first.wait()
    held = buffers.held_bytes
    assert held > 1_200_000  # kept after the write
    ptr = buffers.snapshot("optimizer.safetensors", _state()[1])["state.0.exp_avg"].data_ptr()
    second = _background(tmp_path, 2, buffers)
    second.wait()
    assert buffers.held_bytes == held  # nothing new was allocated
    again = buffers.snapshot("optimizer.safetensors", _state()[1])["state.0.exp_avg"]
    assert again.data_ptr() == ptr
    del again
    # another layout (a tensor grew): a new buffer replaces the kept one
    grown = {**_state()[1], "state.0.exp_avg": torch.randn(101_000)}
    buffers.snapshot("optimizer.safetensors", grown)
    gc.collect()
    assert buffers.held_bytes == held + 4000  # 1000 more float32
    buffers.clear()
    gc.collect()
    assert buffers.held_bytes == 0


def test_a_failed_background_write_gives_the_memory_back_too() -> None:
    _enospc_fs.register()
    _enospc_fs.reset()
    buffers = SnapshotBuffers(keep=False)
    # the disk fills during the second file
    save = _background("fulldisk://vol/run", 1, buffers, storage_options={"capacity": 600_000})
    save.wait()
    assert isinstance(save.error, StorageError)
    gc.collect()
    assert buffers.held_bytes == 0


def test_a_cancelled_background_write_gives_the_memory_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = threading.Event()
    release = threading.Event()
    real = CheckpointWriter.write_entry

    def gated(self: CheckpointWriter, filename: str, data: Any, **kw: Any) -> None:
        started.set()
        release.wait(10)
        real(self, filename, data, **kw)

    monkeypatch.setattr(CheckpointWriter, "write_entry", gated)
    buffers = SnapshotBuffers()  # the default: keep=False
    save = _background(tmp_path, 1, buffers)
    assert started.wait(10)
    assert buffers.held_bytes > 0
    assert save.writer.cancel is not None
    save.writer.cancel.set()  # what BackgroundSave.cancel() sets, before the writer goes on
    release.set()
    save.cancel()
    assert save.cancelled
    gc.collect()
    assert buffers.held_bytes == 0
