"""How many bytes this process read from checkpoint storage: one counter, fed by the storage seam.

Every read that :class:`~trainer_runtime.checkpoint.storage.Storage` serves (whole files,
streamed handles, ranged reads, local or object store) adds the bytes it returned, so a test or
a benchmark can hold a resume to its share (e.g. FSDP: about ``total / N`` per rank) without
trusting the code under test to report itself. Reads that bypass the seam (a file memory-mapped
by ``safe_open``) are not seen: code that wants its reads counted goes through ``Storage``.
Thread-safe (readers run on helper threads); torch-free.
"""

from __future__ import annotations

import threading
from typing import Any, BinaryIO

__all__ = ["CountingHandle", "add", "bytes_read", "reset"]

_lock = threading.Lock()
_total = 0


def add(nbytes: int) -> None:
    """Count ``nbytes`` read from storage."""
    global _total
    if nbytes > 0:
        with _lock:
            _total += nbytes


def bytes_read() -> int:
    """Bytes read from storage by this process since start (or the last :func:`reset`)."""
    with _lock:
        return _total


def reset() -> int:
    """Start counting from zero; returns the count before."""
    global _total
    with _lock:
        before, _total = _total, 0
    return before


class CountingHandle:
    """A binary read handle that counts what ``read``/``readinto`` return; the rest is passed
    through (seek, tell, close...)."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        add(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._handle.readinto(buffer)
        add(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __enter__(self) -> CountingHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.close()
