"""Pure parts of the FSDP resume: which rows no saved piece covers, which rank checks which
file, and header entries checked before any range is read."""

from __future__ import annotations

import json

import pytest
import torch

from trainer_runtime.checkpoint.safetensors_stream import TensorEntry, plan, tensor_entries
from trainer_runtime.distributed.fsdp import _batches, _Read, uncovered, verifier_of
from trainer_runtime.errors import CheckpointError


@pytest.mark.parametrize(
    ("lo", "hi", "spans", "gaps"),
    [
        (0, 8, [(0, 4), (4, 8)], []),
        (0, 8, [(0, 4), (5, 8)], [(4, 5)]),
        (2, 6, [(0, 3)], [(3, 6)]),
        (0, 8, [], [(0, 8)]),
        (4, 8, [(0, 4), (8, 12)], [(4, 8)]),
        (0, 8, [(6, 9), (0, 2), (1, 5)], [(5, 6)]),
        (3, 3, [], []),
    ],
)
def test_uncovered_rows(lo: int, hi: int, spans: list, gaps: list) -> None:
    assert uncovered(lo, hi, spans) == gaps


@pytest.mark.parametrize(
    ("files", "world", "verifiers"),
    [
        (2, 2, [0, 1]),  # the saving world size: each rank checks the file it reads anyway
        (4, 2, [0, 0, 1, 1]),
        (2, 4, [0, 2]),
        (2, 3, [0, 1]),
        (3, 2, [0, 0, 1]),
    ],
)
def test_each_file_is_checked_by_one_rank(files: int, world: int, verifiers: list) -> None:
    assert [verifier_of(i, files, world) for i in range(files)] == verifiers


def test_header_entries_give_absolute_byte_ranges() -> None:
    head, _ = plan({"a": torch.zeros(2, 3), "s": torch.tensor(1.0, dtype=torch.float64)})
    header = json.loads(head[8:])
    entries = tensor_entries(header, len(head))
    assert entries["s"] == TensorEntry(torch.float64, (), len(head), len(head) + 8)
    assert entries["a"] == TensorEntry(torch.float32, (2, 3), len(head) + 8, len(head) + 32)


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}, "do not hold shape"),
        ({"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}, "malformed"),
        ({"dtype": "F32", "shape": [1]}, "malformed"),
    ],
)
def test_inconsistent_header_entries_are_refused(entry: dict, needle: str) -> None:
    with pytest.raises(CheckpointError, match=needle):
        tensor_entries({"t": entry}, 16)


MiB = 1 << 20


def _r(begin: int, end: int, *, direct: bool = False) -> _Read:
    return _Read(begin, end, dest=memoryview(bytearray(end - begin)) if direct else None)


@pytest.mark.parametrize(
    ("reads", "groups"),
    [
        # adjacent small ranges: one read
        ([_r(0, 4), _r(4, 8), _r(8, 100, direct=True)], [[0, 4, 8]]),
        # a large direct read stays alone (no copy through scratch), its neighbours too
        (
            [_r(0, 4), _r(4, 4 + 2 * MiB, direct=True), _r(4 + 2 * MiB, 5 + 2 * MiB)],
            [[0], [4], [4 + 2 * MiB]],
        ),
        # not adjacent: separate reads
        ([_r(0, 4), _r(8, 12)], [[0], [8]]),
        # at most CHUNK_BYTES per read
        ([_r(0, 40 * MiB), _r(40 * MiB, 80 * MiB)], [[0], [40 * MiB]]),
        ([], []),
    ],
    ids=["adjacent", "large-direct", "apart", "chunk", "none"],
)
def test_reads_are_batched(reads: list, groups: list) -> None:
    assert [[r.begin for r in batch] for batch in _batches(reads)] == groups
