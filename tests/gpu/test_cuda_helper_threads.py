"""CUDA calls on checkpoint helper threads run on the tensors' device (marker ``cuda``).

Writer threads, the parallel file writers, the pin-ahead thread and whichever thread drops a
pinned buffer's last view have no current device of their own: without
``staging.on_device`` their first CUDA call (``cudaHostRegister``, an event, the unregister)
creates a context on GPU 0. tests/unit/checkpoint/test_staging_device.py checks the mechanism on
the CPU; here it runs on real devices:

* any GPU count: every ``cudaHostRegister``/``cudaHostUnregister`` made on a helper thread runs
  with ``torch.cuda.current_device()`` equal to the tensors' device (the last device);
* two GPUs or more: a blocking save, a background save and a pin-ahead of tensors on device 1,
  in a fresh process that only ever set device 1, leave no primary context on device 0 (the
  driver's ``cuDevicePrimaryCtxGetState``).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.checkpoint import staging
from trainer_runtime.checkpoint.background import BackgroundSave, snapshot_entry
from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.pinned import PinnedStaging
from trainer_runtime.checkpoint.safetensors_stream import TensorFile

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available"),
]

MIB = 1 << 20


def _state(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {
        "a": torch.randn(40 * MIB, device=device, generator=g),  # 160 MiB: both files parallel
        "b": torch.randn(3000, 2001, device=device, generator=g).bfloat16(),
    }


class _SpyCudart:
    """The real runtime calls, recording the calling thread and its current device."""

    def __init__(self) -> None:
        self.real = torch.cuda.cudart()
        self.calls: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()

    def _note(self, name: str) -> None:
        with self._lock:
            self.calls.append((name, threading.current_thread().name, torch.cuda.current_device()))

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any:
        self._note("register")
        return self.real.cudaHostRegister(ptr, size, flags)

    def cudaHostUnregister(self, ptr: int) -> Any:
        self._note("unregister")
        return self.real.cudaHostUnregister(ptr)


def test_helper_threads_pin_and_unpin_on_the_tensors_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    spy = _SpyCudart()
    monkeypatch.setattr(staging, "_cudart", lambda: spy)
    staging.staging_pool.clear()  # the writers' rings are pinned fresh, on their threads
    tensors = _state(device)
    with torch.cuda.device(device):
        # a blocking save: two large files written at once by the ckpt-file threads
        writer = CheckpointWriter(str(tmp_path), 1)
        writer.begin()
        writer.write_entries(
            [
                ("model.safetensors", TensorFile(dict(tensors)), False),
                (
                    "optimizer.safetensors",
                    TensorFile({k + ".m": v for k, v in tensors.items()}),
                    False,
                ),
            ]
        )
        assert writer.commit().complete
        # a background save: snapshot (training thread), memory dropped by the writer thread
        staged = PinnedStaging(False)
        entry = snapshot_entry("model.safetensors", TensorFile(tensors), staged.buffers)
        staged.after_snapshot(0.0)
        writer = CheckpointWriter(str(tmp_path), 2)
        entries = [("model.safetensors", entry, False)]
        del entry  # the writer thread holds the snapshot's last reference (it clears entries)
        job = BackgroundSave(writer, entries, begin=True)
        job.wait()
        assert job.error is None
        writer.commit()
        # pin ahead of the next one, on its side thread, then given back on another thread
        thread = staged.maybe_pin_ahead(9, 10, 1.0, writing=False)
        assert thread is not None
        thread.join()
    dropper = threading.Thread(target=lambda: (staged.clear(), gc.collect()), name="dropper")
    dropper.start()
    dropper.join()
    staging.staging_pool.clear()
    gc.collect()
    helpers = [c for c in spy.calls if c[1] != "MainThread"]
    names = {c[1].split("_")[0].rstrip("-0123456789") for c in helpers}
    assert {"ckpt-file", "checkpoint-writer", "ckpt-pin-ahead", "dropper"} <= names, spy.calls
    assert all(c[2] == device.index for c in spy.calls), spy.calls


_CHILD = r"""
import ctypes, gc, json, sys, tempfile
import torch
from trainer_runtime.checkpoint import staging
from trainer_runtime.checkpoint.background import BackgroundSave, snapshot_entry
from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.pinned import PinnedStaging
from trainer_runtime.checkpoint.safetensors_stream import TensorFile

cuda = ctypes.CDLL("libcuda.so.1")

def active():
    out = []
    for i in range(torch.cuda.device_count()):
        dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
        assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
        out.append(on.value)
    return out

torch.cuda.set_device(1)
d = torch.device("cuda", 1)
t = {"a": torch.randn(40 << 20, device=d), "b": torch.randn(3000, 2001, device=d).bfloat16()}
torch.cuda.synchronize(d)
before = active()
root = tempfile.mkdtemp()
w = CheckpointWriter(root, 1)
w.begin()
w.write_entries([("model.safetensors", TensorFile(dict(t)), False),
                 ("optimizer.safetensors", TensorFile({k + ".m": v for k, v in t.items()}), False)])
w.commit()
staged = PinnedStaging(False)
entry = snapshot_entry("model.safetensors", TensorFile(t), staged.buffers)
staged.after_snapshot(0.0)
w = CheckpointWriter(root, 2)
job = BackgroundSave(w, [("model.safetensors", entry, False)], begin=True)
del entry
job.wait()
assert job.error is None, job.error
w.commit()
staged.maybe_pin_ahead(9, 10, 1.0, writing=False).join()
staged.clear(); staging.staging_pool.clear(); gc.collect()
print(json.dumps({"before": before, "after": active()}))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_save_of_tensors_on_device_1_creates_no_context_on_device_0() -> None:
    done = subprocess.run(
        [sys.executable, "-P", "-c", _CHILD], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    states = json.loads(done.stdout.strip().splitlines()[-1])
    assert states["before"][0] == 0, states  # only device 1 was ever set
    assert states["after"][0] == 0, states
    assert states["after"][1] == 1, states
