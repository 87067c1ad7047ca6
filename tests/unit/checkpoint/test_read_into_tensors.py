"""A safetensors file read straight into the model's tensors (issue 38.5: the cold resume).

One sequential pass: bytes round-trip for every dtype, into the destination's own memory where it
fits (new memory otherwise), every byte of the file (header, gaps, tail) through the checksum in
file order, and the model load through load_model_files takes that path for our reader.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from safetensors.torch import save as st_save
from torch import nn

from trainer_runtime.checkpoint.hf_format import load_model_files
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.checkpoint.safetensors_stream import TensorFile, read_into_tensors
from trainer_runtime.errors import CheckpointError, ResumeError


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(7, 5, generator=g),
        "half": torch.randn(3, generator=g).half(),
        "bf": torch.randn(4, 2, generator=g).bfloat16(),
        "idx": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "i8": torch.tensor([-1, 2], dtype=torch.int8),
    }


def _read(
    path: Path, into: dict[str, torch.Tensor], block: int = 1 << 20
) -> tuple[dict[str, torch.Tensor], bytes]:
    seen = bytearray()
    with open(path, "rb", buffering=0) as fh:
        _, tensors = read_into_tensors(
            fh.fileno(), path.stat().st_size, into, lambda b: seen.extend(b), block=block
        )
    return tensors, bytes(seen)


@pytest.mark.parametrize("block", [3, 64, 1 << 20], ids=["3 B", "64 B", "1 MiB"])
def test_every_dtype_round_trips_into_its_destination(tmp_path: Path, block: int) -> None:
    src = _mixed()
    path = tmp_path / "m.safetensors"
    path.write_bytes(TensorFile(src, {"k": "v"}).to_bytes())
    into = {name: torch.full_like(t, 0) for name, t in src.items()}
    ptrs = {name: t.data_ptr() for name, t in into.items()}
    tensors, seen = _read(path, into, block)
    assert seen == path.read_bytes()  # every byte once, in file order
    for name, t in src.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
        assert tensors[name] is into[name], f"{name} not read into its destination"
        assert into[name].data_ptr() == ptrs[name]


@pytest.mark.parametrize(
    "dest",
    [
        torch.zeros(5, 7),  # another shape
        torch.zeros(7, 5, dtype=torch.float64),  # another dtype
        torch.zeros(5, 7).t(),  # right shape, not contiguous
    ],
    ids=["shape", "dtype", "strided"],
)
def test_a_destination_that_does_not_fit_is_left_alone(tmp_path: Path, dest: torch.Tensor) -> None:
    src = {"w": torch.randn(7, 5), "b": torch.randn(5)}
    path = tmp_path / "m.safetensors"
    path.write_bytes(st_save(src))
    before = dest.clone()
    b_dest = torch.zeros(5)
    tensors, _ = _read(path, {"w": dest, "b": b_dest})
    assert tensors["w"] is not dest and torch.equal(tensors["w"], src["w"])
    assert torch.equal(dest, before)
    assert tensors["b"] is b_dest and torch.equal(b_dest, src["b"])


def _with_gap_and_tail(path: Path) -> dict[str, torch.Tensor]:
    """A hand-made file: 16 bytes between its two tensors and 5 after the last."""
    a, b = torch.arange(4, dtype=torch.float32), torch.arange(3, dtype=torch.int16)
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "I16", "shape": [3], "data_offsets": [32, 38]},
    }
    text = json.dumps(header).encode()
    body = a.numpy().tobytes() + b"\x07" * 16 + b.numpy().tobytes() + b"tail!"
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)
    return {"a": a, "b": b}


def test_gaps_and_tail_are_read_and_checksummed_but_not_kept(tmp_path: Path) -> None:
    path = tmp_path / "g.safetensors"
    src = _with_gap_and_tail(path)
    tensors, seen = _read(path, {})
    assert seen == path.read_bytes()
    assert set(tensors) == {"a", "b"}
    assert all(torch.equal(tensors[k], src[k]) for k in src)


def test_a_file_shorter_than_its_header_says_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    data = st_save({"w": torch.randn(64)})
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError):
        _read(path, {"w": torch.zeros(64)})


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied: saved once
        self.register_buffer("scale", torch.ones(6, dtype=torch.float64))


def test_our_reader_loads_the_model_in_place_and_verifies(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = _Tied()
    with torch.no_grad():
        saved.scale.mul_(3)
    w = CheckpointWriter(str(tmp_path), 1)
    w.begin()
    from trainer_runtime.checkpoint.model_state import MODEL_NAME, model_state_tensors

    tensors, meta = model_state_tensors(saved)
    w.write_tensors(MODEL_NAME, tensors, meta)
    info = w.commit()

    torch.manual_seed(1)
    model = _Tied()
    ptrs = {n: t.data_ptr() for n, t in model.state_dict().items()}
    reader = CheckpointReader(info.path)
    handed: dict[str, torch.Tensor] = {}

    def load(name: str, *, into: dict[str, torch.Tensor] | None = None) -> Any:
        got = reader.load_tensors_and_metadata(name, into=into)
        handed.update(got[0])
        return got

    load_model_files(model, reader.load_bytes, reader.has, info.path, load=load)
    reader.wait_verified()
    for name, t in saved.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
        assert model.state_dict()[name].data_ptr() == ptrs[name]
    # the file's tensors were read into the parameters themselves (no mapping, no copy)
    assert handed.keys() == tensors.keys()
    assert all(handed[n].data_ptr() == ptrs[n] for n in handed)
    assert model.head.weight is model.emb.weight

    # the one pass feeds the checksum: a flipped tensor byte is found
    path = Path(info.path) / MODEL_NAME
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    manifest = (Path(info.path) / "manifest.json").read_text()
    assert xxhash.xxh3_128(bytes(raw)).hexdigest() not in manifest
    reader = CheckpointReader(info.path)
    load_model_files(_Tied(), reader.load_bytes, reader.has, info.path,
                     load=reader.load_tensors_and_metadata)  # fmt: skip
    with pytest.raises(ResumeError, match="corrupt"):
        reader.wait_verified()
    assert os.path.exists(path)


def test_a_model_off_the_host_keeps_the_mapped_load() -> None:
    from trainer_runtime.checkpoint.hf_format import in_place_targets

    model = _Tied()
    assert in_place_targets(model) is not None
    model.register_buffer("elsewhere", torch.empty(3, device="meta"))
    assert in_place_targets(model) is None
