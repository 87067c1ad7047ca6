"""The optimizer file read into a buffer faulted in on a helper (issue 38.5: the cold resume).

``CheckpointReader.prepare_owned`` allocates the buffer and faults its pages in (last first) on a
helper while something else (the model file) is read; the owned load then reads into that very
buffer, the helper possibly still at work. Faulting in never changes the bytes; the checksum is
still fed from the same pass, a corrupt file is still refused, a file that changed size since is
read into new memory (and a short one refused), and a buffer never used is dropped.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.model_state import OPTIMIZER_NAME
from trainer_runtime.checkpoint.safetensors_stream import (
    fault_in,
    fault_in_alongside,
    read_into_buffer,
)
from trainer_runtime.errors import CheckpointError, ResumeError


def _optimizer_state() -> dict:
    g = torch.Generator().manual_seed(3)
    state = {
        i: {
            "step": torch.tensor(float(i + 1)),
            "exp_avg": torch.randn(33, 7, generator=g),
            "exp_avg_sq": torch.rand(33, 7, generator=g),
        }
        for i in range(3)
    }
    groups = [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1, 2]}]
    return {"state": state, "param_groups": groups}


def _checkpoint(tmp_path: Path) -> str:
    w = CheckpointWriter(str(tmp_path), 1)
    w.begin()
    w.write_optimizer_state(OPTIMIZER_NAME, _optimizer_state())
    return w.commit().path


def _same(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for pid, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][pid][key]), f"{pid}.{key}"


@pytest.mark.parametrize("chunk", [4096, 1 << 20, 64 << 20])
@pytest.mark.parametrize("size", [0, 1, 4095, 4097, 3 << 20])
def test_fault_in_keeps_the_bytes(size: int, chunk: int) -> None:
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8)
    before = buf.clone()
    assert fault_in(buf, chunk=chunk)  # this kernel has MADV_POPULATE_WRITE (Linux >= 5.14)
    assert torch.equal(buf, before)


@pytest.mark.parametrize(("cpus", "alongside"), [(0, False), (1, False), (2, True), (64, True)])
def test_fault_in_alongside_only_with_a_spare_core(cpus: int, alongside: bool) -> None:
    assert fault_in_alongside(cpus) is alongside


def test_fault_in_stops_when_told() -> None:
    stop = threading.Event()
    stop.set()
    assert fault_in(torch.empty(8 << 20, dtype=torch.uint8), stop)


def test_fault_in_while_the_buffer_is_written() -> None:
    buf = torch.empty(64 << 20, dtype=torch.uint8)
    helper = threading.Thread(target=fault_in, args=(buf,), kwargs={"chunk": 1 << 20})
    helper.start()
    for lo in range(0, buf.numel(), 4 << 20):  # front to back, as the read does
        buf[lo : lo + (4 << 20)] = lo >> 22
    helper.join()
    assert all(int(buf[lo]) == lo >> 22 for lo in range(0, buf.numel(), 4 << 20))
    assert int(buf[-1]) == (buf.numel() - 1) >> 22


def test_read_into_buffer_reads_into_the_given_tensor(tmp_path: Path) -> None:
    data = bytes(range(256)) * 4099
    path = tmp_path / "f"
    path.write_bytes(data)
    out = torch.empty(len(data), dtype=torch.uint8)
    fault_in(out)
    seen = bytearray()
    with open(path, "rb", buffering=0) as fh:
        buf = read_into_buffer(fh, len(data), seen.extend, out=out)
    assert buf is out and bytes(out.numpy()) == data and bytes(seen) == data


@pytest.mark.parametrize(
    "out",
    [torch.empty(10, dtype=torch.uint8), torch.empty(11, dtype=torch.int8),
     torch.empty(22, dtype=torch.uint8)[::2]],
    ids=["size", "dtype", "strided"],
)  # fmt: skip
def test_read_into_buffer_refuses_a_buffer_that_does_not_fit(
    tmp_path: Path, out: torch.Tensor
) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 11)
    with open(path, "rb", buffering=0) as fh, pytest.raises(ValueError, match="11 bytes"):
        read_into_buffer(fh, 11, out=out)


def test_read_into_buffer_refuses_a_short_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    with open(path, "rb", buffering=0) as fh, pytest.raises(CheckpointError, match="ended"):
        read_into_buffer(fh, 200, out=torch.empty(200, dtype=torch.uint8), threads=1)


def test_the_optimizer_is_read_into_the_prepared_buffer_and_verified(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    reader = CheckpointReader(path)
    reader.prepare_owned(OPTIMIZER_NAME)
    prepared = reader._prepared[OPTIMIZER_NAME]
    state = reader.load_optimizer()
    reader.wait_verified()
    assert state is not None
    _same(state, _optimizer_state())
    lo, hi = prepared.data_ptr(), prepared.data_ptr() + prepared.numel()
    for entry in state["state"].values():
        for value in entry.values():
            assert lo <= value.data_ptr() < hi, "not a view of the prepared buffer"
    assert not reader._prepared and not reader._faulting


def test_a_corrupt_optimizer_file_is_still_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    file = Path(path) / OPTIMIZER_NAME
    raw = bytearray(file.read_bytes())
    raw[-5] ^= 0x40  # a tensor byte: same size, so the prepared buffer is used
    reader = CheckpointReader(path)
    reader.prepare_owned(OPTIMIZER_NAME)
    file.write_bytes(bytes(raw))
    reader.load_optimizer()
    with pytest.raises(ResumeError, match="corrupt"):
        reader.wait_verified()


def test_a_file_that_shrank_after_prepare_is_refused(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    file = Path(path) / OPTIMIZER_NAME
    reader = CheckpointReader(path)
    reader.prepare_owned(OPTIMIZER_NAME)
    file.write_bytes(file.read_bytes()[:-100])  # the buffer no longer fits: not used
    with pytest.raises(ResumeError):
        reader.load_optimizer()
        reader.wait_verified()


def test_a_file_that_grew_after_prepare_is_read_into_new_memory(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    file = Path(path) / OPTIMIZER_NAME
    reader = CheckpointReader(path)
    reader.prepare_owned(OPTIMIZER_NAME)
    prepared = reader._prepared[OPTIMIZER_NAME]
    file.write_bytes(file.read_bytes() + b"\0" * 64)
    state = reader.load_optimizer()
    assert state is not None
    lo, hi = prepared.data_ptr(), prepared.data_ptr() + prepared.numel()
    assert not lo <= state["state"][0]["exp_avg"].data_ptr() < hi
    with pytest.raises(ResumeError, match="corrupt"):  # not the bytes the manifest lists
        reader.wait_verified()


def test_a_prepared_buffer_never_loaded_is_dropped(tmp_path: Path) -> None:
    reader = CheckpointReader(_checkpoint(tmp_path))
    reader.prepare_owned(OPTIMIZER_NAME)
    reader.prepare_owned(OPTIMIZER_NAME)  # once per file
    assert len(reader._prepared) == 1
    reader.prepare_owned("missing.safetensors")  # nothing to prepare: the load reports it
    assert "missing.safetensors" not in reader._prepared
    reader.wait_verified()
    assert not reader._prepared and not reader._faulting
