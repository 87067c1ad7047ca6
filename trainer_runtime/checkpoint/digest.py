"""The checksum of each checkpoint file, listed in ``manifest.json`` beside the file's size.

New checkpoints list ``xxh3_128``: xxHash's 128-bit XXH3 of the file's bytes, in hex. A resume
checks every byte before the first step. With sha256 (what checkpoints listed before), that
check alone took 0.72 s of CPU for the 1.2 GB of a 100M-parameter model with AdamW (sha256
runs at 1.5-1.7 GB/s on one core of this CPU, with its SHA extensions), about as long as
transformers' whole resume. XXH3 runs at 13-14 GB/s and, like hashlib, releases the GIL.

The checksum is there to catch torn, truncated or corrupted files (a storage fault, an
interrupted copy), not tampering: whoever can rewrite a file can rewrite the manifest too, so a
cryptographic hash bought nothing. A 128-bit hash leaves a random corruption undetected with
probability 2**-128.

Checkpoints that list ``sha256`` (written before) are still verified with it. This module is
torch-free (the operator imports the storage modules, so its image carries xxhash too).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, BinaryIO, Protocol

import xxhash

from trainer_runtime.errors import CheckpointError

__all__ = [
    "ALGORITHM",
    "ALGORITHMS",
    "Hasher",
    "file_record",
    "hash_stream",
    "listed_digest",
    "new_hasher",
]

ALGORITHM = "xxh3_128"
# every algorithm a manifest may name, preferred first
ALGORITHMS = (ALGORITHM, "sha256")


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str = ALGORITHM) -> Hasher:
    """A fresh hasher for ``algorithm`` (one of :data:`ALGORITHMS`)."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(
        f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})"
    )


def hash_stream(fh: BinaryIO, algorithm: str = ALGORITHM, chunk: int = 16 << 20) -> tuple[int, str]:
    """(size, hex digest) of what is left to read in ``fh``, read into one reused buffer
    (a fresh buffer per block would be fresh memory to touch each time: slow on this VM)."""
    hasher = new_hasher(algorithm)
    block = bytearray(chunk)
    view = memoryview(block)
    size = 0
    while n := fh.readinto(block):  # type: ignore[attr-defined]
        hasher.update(view[:n])
        size += n
    return size, hasher.hexdigest()


def listed_digest(entry: Mapping[str, Any]) -> tuple[str, str] | None:
    """(algorithm, hex digest) a manifest's file entry lists, or None if it lists none."""
    for algorithm in ALGORITHMS:
        value = entry.get(algorithm)
        if value:
            return algorithm, str(value)
    return None


def file_record(path: str, size: int, digest: str) -> dict[str, Any]:
    """A manifest entry for a file hashed with :data:`ALGORITHM`."""
    return {"path": path, "size": size, ALGORITHM: digest}
