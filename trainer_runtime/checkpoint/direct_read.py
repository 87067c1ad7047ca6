"""Cold files read around the page cache (``O_DIRECT``) into an aligned buffer (issue 38.5).

A resume on a new node reads the checkpoint from the disk. Through the page cache every byte is
read into freshly allocated cache pages and then copied into the destination; with ``O_DIRECT``
the disk writes straight into the destination (the optimizer file's buffer, faulted in ahead on
a helper: ``CheckpointReader.prepare_owned``). Measured on the project's VM, the 800 MB optimizer
file of 100M parameters into a prepared buffer, cold: 0.48-0.61 s with ``O_DIRECT`` against
0.58-0.81 s through the page cache (docs/checkpoints.md, "Measured").

A file already in the page cache (a restart on the same node) is read through it: ``O_DIRECT``
would go to the disk again. :func:`resident_fraction` tells (``mincore`` of a mapping of the
file, no page touched). Where the filesystem has no ``O_DIRECT`` (tmpfs, some network and FUSE
filesystems) or refuses a request, the read goes on through the page cache
(:func:`open_direct` returns None; ``read_into_buffer`` falls back per request).

Switch: ``$PREEMPTIBLE_DIRECT_READ`` (``0`` off, ``1`` on; default on for a cold file).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Any

import torch

from trainer_runtime.checkpoint.direct_io import (
    ALIGN,
    FUSE_SUPER_MAGIC,
    READ_REFUSED,
    direct_io_supported,
    filesystem_magic,
)

__all__ = [
    "ALIGN",
    "COLD_BELOW",
    "REFUSED",
    "aligned_empty",
    "close_quietly",
    "direct_reads_enabled",
    "open_direct",
    "resident_fraction",
]

ENV = "PREEMPTIBLE_DIRECT_READ"
# A file with less than this fraction of its pages in the page cache is read with O_DIRECT.
COLD_BELOW = 0.5
# resident_fraction: a large file's residency from this many windows of this many bytes
SAMPLE_WINDOWS = 64
SAMPLE_BYTES = 1 << 20
REFUSED = READ_REFUSED
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_libc: Any = None


def direct_reads_enabled() -> bool:
    """``$PREEMPTIBLE_DIRECT_READ``: ``0`` turns direct reads off; anything else (or unset):
    on, where the platform has ``O_DIRECT``."""
    return direct_io_supported() and os.environ.get(ENV, "").strip() != "0"


def aligned_empty(size: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of ``size`` bytes whose first byte is :data:`ALIGN`
    aligned (a view into a slightly larger allocation), as ``O_DIRECT`` reads need."""
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip : skip + size]


def _lib() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        _libc = libc
    return _libc


def resident_fraction(
    fd: int, size: int, *, windows: int = SAMPLE_WINDOWS, window: int = SAMPLE_BYTES
) -> float | None:
    """Fraction of the first ``size`` bytes of ``fd`` in the page cache (``mincore`` of a
    read-only mapping: no page is read or touched); None where it cannot be told. A file
    larger than ``windows`` x ``window`` bytes is sampled in that many windows spread evenly
    over it (the whole of 800 MB took 12-19 ms warm; a shard of tens of GB would take ~1 s)."""
    if size <= 0:
        return 1.0
    try:
        libc = _lib()
    except (OSError, AttributeError):
        return None
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        return None
    page = mmap.PAGESIZE
    window = max(page, window // page * page)
    if size <= windows * window:
        ranges = [(0, size)]
    else:
        step = (size - window) // (windows - 1) // page * page
        ranges = [(i * step, window) for i in range(windows)]
    try:
        total = resident = 0
        for start, length in ranges:
            pages = -(-length // page)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr + start, length, vec) != 0:
                return None
            # one byte a page, bit 0 set where resident (the other bits are reserved, zero)
            total += pages
            resident += pages - vec.raw.count(0)
        return resident / total
    finally:
        libc.munmap(addr, size)


def open_direct(path: str, size: int) -> int | None:
    """A read-only ``O_DIRECT`` descriptor of ``path`` where a direct read of its ``size``
    bytes is wanted: direct reads on (:func:`direct_reads_enabled`), not a FUSE mount, the file
    mostly not in the page cache (:data:`COLD_BELOW`), and the filesystem takes the flag.
    None otherwise: read it through the page cache."""
    if size < ALIGN or not direct_reads_enabled():
        return None
    if filesystem_magic(path) == FUSE_SUPER_MAGIC:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        resident = resident_fraction(fd, size)
    finally:
        os.close(fd)
    if resident is None or resident >= COLD_BELOW:
        return None
    try:
        return os.open(path, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in REFUSED:
            return None  # tmpfs and others: no O_DIRECT
        raise


def close_quietly(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
