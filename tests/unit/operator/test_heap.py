"""The operator's heap trim (operator/heap.py): memory freed after a burst goes back to the OS."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from preemptible_operator import cli, heap
from preemptible_operator.reconcile import OperatorConfig

_BURST = """
import ctypes, sys
from preemptible_operator import heap

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 64 KiB blocks come from the heap, not mmap
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() alone gives nothing back
blocks = []
for _ in range(3000):  # 192 MiB in 64 KiB blocks, each touched
    p = libc.malloc(64 << 10)
    ctypes.memset(p, 1, 64 << 10)
    blocks.append(p)
for p in blocks[:-1]:  # the last one pins the top of the heap: only a trim frees the rest
    libc.free(p)
held = rss_kib()
trimmed = heap.trim() if sys.argv[1] == "trim" else False
print(trimmed, held - rss_kib())
"""


@pytest.mark.parametrize("trim", [True, False])
def test_a_trim_gives_freed_heap_memory_back(trim: bool, tmp_path: Path) -> None:
    """Blocks under glibc's mmap threshold stay in the heap once freed (what a burst of decoded
    bodies leaves): RSS goes down only with the trim. In a process of its own: the malloc
    settings it needs are global."""
    if heap._malloc_trim() is None:
        pytest.skip("not glibc")
    out = subprocess.run(
        [sys.executable, "-P", "-c", _BURST, "trim" if trim else "keep"],
        capture_output=True, text=True, check=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    trimmed, freed_kib = out.stdout.split()
    assert trimmed == str(trim)
    if trim:
        assert int(freed_kib) > 150 << 10, out.stdout
    else:
        assert int(freed_kib) < 16 << 10, out.stdout


def test_trimming_runs_on_its_own_thread_and_stops() -> None:
    stop = threading.Event()
    calls = threading.Event()
    real = heap.trim

    def counted() -> bool:
        calls.set()
        return real()

    heap.trim = counted  # type: ignore[assignment]
    try:
        thread = heap.start_trimming(0.01, stop)
        assert thread is not None and thread.daemon
        assert calls.wait(2)
    finally:
        stop.set()
        heap.trim = real  # type: ignore[assignment]
    thread.join(2)
    assert not thread.is_alive()


def test_no_trimming_when_off() -> None:
    assert heap.start_trimming(0) is None


def test_the_flag_reaches_the_config() -> None:
    args = cli.build_parser().parse_args(["run", "--heap-trim-interval", "0"])
    assert args.heap_trim_interval == 0
    assert cli.build_parser().parse_args(["run"]).heap_trim_interval == 60.0
    assert OperatorConfig().heap_trim_interval == 60.0
