"""CUDA calls on helper threads run on the tensor's device (checkpoint/staging.py, on_device).

The CUDA seam only is replaced (``staging._cuda_device``: setting a thread's current device;
``staging._cudart``: ``cudaHostRegister``/``Unregister``; ``staging._can_pin``): each call is
recorded with the thread that made it and the device current on that thread then. Everything
else is the real code: buffers, the staging pool, snapshot buffers, the pin-ahead thread, a
writer thread dropping the last view. tests/gpu/test_cuda_helper_threads.py checks the same on
a real device.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trainer_runtime.checkpoint import staging
from trainer_runtime.checkpoint.background import SnapshotBuffers
from trainer_runtime.checkpoint.pinned import PinnedStaging


class FakeCuda:
    """Records the CUDA runtime calls with the calling thread's current device (None: never
    set on that thread, where CUDA would take device 0)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.calls: list[tuple[str, str, int | None]] = []
        self.entered: list[int] = []

    @property
    def current(self) -> int | None:
        return getattr(self._local, "device", None)

    @contextlib.contextmanager
    def device(self, index: int) -> Iterator[None]:
        self.entered.append(index)
        before, self._local.device = self.current, index
        try:
            yield
        finally:
            self._local.device = before

    def _record(self, name: str) -> int:
        self.calls.append((name, threading.current_thread().name, self.current))
        return 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return self._record("register")

    def cudaHostUnregister(self, ptr: int) -> int:
        return self._record("unregister")


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(staging, "_cuda_device", fake.device)
    monkeypatch.setattr(staging, "_cudart", lambda: fake)
    monkeypatch.setattr(staging, "_can_pin", lambda: True)
    return fake


def _in_thread(fn: Any, name: str) -> Any:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), name=name)
    thread.start()
    thread.join()
    return out[0] if out else None


@pytest.mark.parametrize("device", [None, torch.device("cpu"), torch.device("meta")])
def test_on_device_is_a_no_op_off_cuda(cuda: FakeCuda, device: torch.device | None) -> None:
    with staging.on_device(device):
        assert cuda.current is None
    assert cuda.entered == []


def test_on_device_sets_the_threads_device_for_the_block(cuda: FakeCuda) -> None:
    with staging.on_device(torch.device("cuda", 3)):
        assert cuda.current == 3
    assert cuda.current is None


def test_a_buffer_is_pinned_and_unpinned_on_its_device_whichever_thread_lets_it_go(
    cuda: FakeCuda,
) -> None:
    box: list[torch.Tensor] = []
    _in_thread(
        lambda: box.append(staging.host_buffer(10_000, pin=True, device=torch.device("cuda", 1))),
        "ckpt-file_0",
    )
    # the last view goes on another helper thread (a writer clearing its entries)
    _in_thread(lambda: (box.clear(), gc.collect()), "checkpoint-writer-7")
    assert cuda.calls == [
        ("register", "ckpt-file_0", 1),
        ("unregister", "checkpoint-writer-7", 1),
    ]


def test_a_staging_ring_taken_on_a_writer_thread_is_pinned_on_the_tensors_device(
    cuda: FakeCuda,
) -> None:
    pool = staging.StagingPool(kept=1, block_bytes=1 << 16, depth=2)
    ring = _in_thread(lambda: pool.take(torch.device("cuda", 2)), "ckpt-file_1")
    assert ring.device == torch.device("cuda", 2)
    assert cuda.calls == [("register", "ckpt-file_1", 2)]
    del ring
    gc.collect()
    assert cuda.calls[-1] == ("unregister", "MainThread", 2)


def test_pinning_ahead_on_its_side_thread_runs_on_the_snapshots_device(cuda: FakeCuda) -> None:
    staged = PinnedStaging(False)
    buffers = staged.buffers
    # what a snapshot of a file of CUDA tensors on device 1 leaves (its layout and device)
    layout = (("w", torch.float32, (256, 64)), ("b", torch.bfloat16, (64,)))
    buffers._layouts[("model.safetensors", True)] = (layout, torch.device("cuda", 1))
    staged.after_snapshot(0.5)
    assert staged.mode == "pin_ahead"
    thread = staged.maybe_pin_ahead(9, 10, 0.01, writing=False)
    assert thread is not None
    thread.join()
    assert cuda.calls == [("register", "ckpt-pin-ahead", 1)]
    assert buffers.held_bytes == 256 * 64 * 4 + 4096  # each tensor page-aligned
    _in_thread(lambda: (staged.clear(), gc.collect()), "checkpoint-writer-10")
    assert cuda.calls[-1] == ("unregister", "checkpoint-writer-10", 1)
    assert buffers.held_bytes == 0


def test_snapshot_buffers_of_cpu_tensors_touch_no_cuda(cuda: FakeCuda) -> None:
    buffers = SnapshotBuffers()
    buffers.snapshot("model.safetensors", {"w": torch.randn(100, 10)})
    assert cuda.calls == [] and cuda.entered == []
