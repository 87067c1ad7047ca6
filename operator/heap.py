"""Give the operator's freed heap memory back to the OS now and then (glibc's ``malloc_trim``).

Bursts (thousands of TrainingJobs created at once, an operator restart listing them all) decode
and copy many bodies at the same time on the pass threads; once they are freed, glibc keeps most
of those pages in its per-thread heaps, so the operator's RSS stays at the burst's high-water
mark for good. Traced at 1,700 TrainingJobs: RSS 235 MB, 201 MB after one ``malloc_trim(0)``
(docs/operator.md, "Operator at scale"). A trim costs milliseconds every ``interval`` seconds and
changes nothing the operator does; it is for the operator's own process only, never a training
process. Where the C library is not glibc (``malloc_trim`` not found), nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
from collections.abc import Callable

__all__ = ["start_trimming", "trim"]

log = logging.getLogger("preemptible_operator")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        fn = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def trim() -> bool:
    """Return the free memory at the top and inside glibc's heaps to the OS; True where memory
    was given back, False where none was or the C library has no ``malloc_trim``."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


def start_trimming(interval: float, stop: threading.Event | None = None) -> threading.Thread | None:
    """A daemon thread that trims every ``interval`` seconds until ``stop`` is set; None when
    ``interval`` is 0 (off) or the C library cannot trim."""
    if interval <= 0:
        return None
    if _malloc_trim() is None:
        log.info("malloc_trim is not available (not glibc): the heap is not trimmed")
        return None
    stopped = stop or threading.Event()

    def run() -> None:
        while not stopped.wait(interval):
            trim()

    thread = threading.Thread(target=run, name="heap-trim", daemon=True)
    thread.start()
    return thread
