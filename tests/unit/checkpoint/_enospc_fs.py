"""An fsspec filesystem whose "disk" fills up after a given number of bytes (ENOSPC).

Used to test that a failing save raises StorageError and leaves earlier checkpoints complete. It
is an in-memory filesystem with its own store (not shared with ``memory://``); once ``capacity``
bytes have been written through one instance, further writes fail like a full disk.
"""

from __future__ import annotations

import errno
import os
from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

PROTOCOL = "fulldisk"


class FullDiskFileSystem(MemoryFileSystem):
    protocol = PROTOCOL
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    cachable = False  # each Storage gets its own byte budget

    def __init__(self, capacity: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.capacity = capacity
        self.written = 0

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        text = str(path)
        if text.startswith(f"{PROTOCOL}://"):
            text = text[len(PROTOCOL) + 3 :]
        text = text.strip("/")
        return "/" + text if text else ""

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        handle = super()._open(path, mode, **kwargs)
        if "w" in mode or "a" in mode:
            original = handle.write

            def write(data: bytes) -> int:
                if self.capacity is not None and self.written + len(data) > self.capacity:
                    room = max(0, self.capacity - self.written)
                    original(bytes(data[:room]))  # a real disk keeps what fitted
                    self.written += room
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                self.written += len(data)
                return original(data)

            handle.write = write
        return handle


def register() -> None:
    fsspec.register_implementation(PROTOCOL, FullDiskFileSystem, clobber=True)


def reset() -> None:
    FullDiskFileSystem.store.clear()
    FullDiskFileSystem.pseudo_dirs[:] = [""]
