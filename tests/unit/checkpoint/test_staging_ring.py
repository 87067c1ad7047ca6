"""The device-to-host staging ring (checkpoint/staging.py) and write_safetensors' use of it.

No GPU here: CPU tensors are forced through the ring (``stage_host_tensors``), and the copies run
either synchronously (what a device without streams gets) or on a worker thread standing in for
a CUDA side stream: queued in order, run later, waited for through marks that raise a failed
copy's error, like events. tests/gpu runs the same paths on a real CUDA stream.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from safetensors.torch import load
from safetensors.torch import save as st_save

from trainer_runtime.checkpoint import staging
from trainer_runtime.checkpoint.safetensors_stream import Cancelled, TensorFile, write_safetensors
from trainer_runtime.checkpoint.staging import RingStream, StagingPool, StagingRing
from trainer_runtime.checkpoint.storage import Storage


def _address(data: Any) -> tuple[int, int]:
    arr = np.frombuffer(data, dtype=np.uint8)
    start = int(arr.__array_interface__["data"][0]) if len(arr) else 0
    return start, start + len(arr)


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class LateReader:
    """A ``write`` that uses the hand-over contract to its limit: each block is read again (and
    compared with what it held when handed over) at the end of the *next* call, and each call
    holds on for ``hold_s`` so that copies queued before it run meanwhile."""

    def __init__(self, hold_s: float = 0.0) -> None:
        self.hold_s = hold_s
        self.out = bytearray()
        self.calls: list[int] = []
        self.corrupted: list[int] = []
        self._prev: tuple[memoryview, bytes] | None = None
        self.in_use: list[tuple[int, int]] = []  # what the writer may read right now

    def __call__(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        here = _address(view)
        self.in_use = [*self.in_use, here]
        seen = bytes(view)
        if self.hold_s:
            time.sleep(self.hold_s)
        self.out += seen
        self.calls.append(len(view))
        if self._prev is not None and bytes(self._prev[0]) != self._prev[1]:
            self.corrupted.append(len(self.calls) - 1)  # the previous block changed under us
        self._prev = (view, seen)
        self.in_use = [here]
        return len(view)


class ThreadCopies:
    """Copies on one worker thread (a stream): run in queue order, ``delay_s`` each, later than
    queued. Records every copy that targets memory the writer may still read, when queued and
    when run; ``fail_at``: that copy (0-based) raises."""

    def __init__(
        self,
        in_use: Callable[[], list[tuple[int, int]]] = list,
        delay_s: float = 0.0,
        fail_at: int | None = None,
    ) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="test-stream")
        self._futures: list[Future[None]] = []  # not yet marked
        self._all: list[Future[None]] = []
        self._in_use = in_use
        self.delay_s = delay_s
        self.fail_at = fail_at
        self.queued = 0
        self.started = 0
        self.targets: list[tuple[int, int]] = []
        self.violations: list[str] = []

    def _check(self, target: tuple[int, int], when: str) -> None:
        if any(_overlaps(target, r) for r in self._in_use()):
            self.violations.append(when)

    def start(self, device: torch.device) -> None:
        self.started += 1

    def order_after_queued_work(self, device: torch.device) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        target = (dst.data_ptr(), dst.data_ptr() + dst.numel() * dst.element_size())
        self.targets.append(target)
        self._check(target, "queued")
        index = self.queued
        self.queued += 1

        def run() -> None:
            if self.delay_s:
                time.sleep(self.delay_s)
            self._check(target, "run")
            if index == self.fail_at:
                raise RuntimeError("copy failed")
            dst.copy_(src)

        future = self._pool.submit(run)
        self._futures.append(future)
        self._all.append(future)

    def mark(self, device: torch.device) -> Callable[[], None]:
        futures, self._futures = self._futures, []

        def wait() -> None:
            for f in futures:
                f.result()

        return wait

    @property
    def pending(self) -> int:
        """Copies queued and not finished (still writing into the ring)."""
        return sum(not f.done() for f in self._all)


def _mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(70, 50, generator=g),
        "half": torch.randn(301, generator=g).half(),
        "bf": torch.randn(40, 21, generator=g).bfloat16(),
        "idx": torch.arange(600, dtype=torch.int64).reshape(20, 30),
        "mask": torch.rand(333, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "i8": torch.tensor([-1, 2, 7], dtype=torch.int8),
        "strided": torch.randn(60, 40, generator=g).t(),  # not contiguous
    }


def _one_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"layer.{i}.weight": torch.randn(97 * (i + 1), 13, generator=g) for i in range(12)}


@pytest.mark.parametrize("block_bytes,depth", [(4096, 4), (1000, 2), (3333, 3), (1 << 20, 4)])
@pytest.mark.parametrize("threaded", [False, True])
def test_bytes_through_the_ring_are_identical_to_safetensors(
    block_bytes: int, depth: int, threaded: bool
) -> None:
    for tensors, meta in ((_one_dtype(), {"format": "pt"}), (_mixed(), None)):
        writer = LateReader()
        copies = ThreadCopies(lambda w=writer: w.in_use) if threaded else None
        ring = StagingRing(block_bytes, depth, copies=copies, stage_host_tensors=True)
        n = write_safetensors(writer, tensors, meta, ring=ring)
        # same bytes as the zero-copy path, which is safetensors' own format
        expected = TensorFile(tensors, meta).to_bytes()
        assert bytes(writer.out) == expected and n == len(expected)
        if meta:
            assert expected == st_save(tensors, metadata=meta)
        loaded = load(bytes(writer.out))
        assert all(torch.equal(loaded[k], t) for k, t in tensors.items())
        assert writer.corrupted == [] and (copies is None or copies.violations == [])
        assert writer.calls[-1] == 0  # the last call releases the last block
        assert copies is None or copies.started == 1  # ordered after the device's work, once
        # every full block is one write call (after the header)
        assert all(c == block_bytes for c in writer.calls[1:-2])


@pytest.mark.parametrize("depth", [2, 3, 4])
def test_a_block_is_never_overwritten_while_the_writer_may_read_it(depth: int) -> None:
    tensors = _one_dtype()
    writer = LateReader(hold_s=0.002)
    # slow copies, queued well ahead: a block reused too early would be overwritten while the
    # writer still reads it (caught when the copy is queued, when it runs, and in the bytes)
    copies = ThreadCopies(lambda: writer.in_use, delay_s=0.001)
    ring = StagingRing(2048, depth, copies=copies, stage_host_tensors=True)
    write_safetensors(writer, tensors, ring=ring)
    assert copies.violations == [] and writer.corrupted == []
    assert bytes(writer.out) == st_save(tensors)
    assert len(writer.calls) > 3 * depth  # the ring went round many times


def test_the_ring_bounds_the_memory_in_flight() -> None:
    tensors = {f"t{i}": torch.randn(64 << 10) for i in range(8)}  # 2 MiB through 4 x 16 KiB
    ring = StagingRing(16 << 10, 4, stage_host_tensors=True)
    mapped = staging.held_bytes()["mapped"]
    peak = [0]

    def write(data: Any) -> int:
        peak[0] = max(peak[0], staging.held_bytes()["mapped"])
        return len(memoryview(data))

    copies = ThreadCopies()
    ring.copies = copies
    stream = RingStream(ring, write)
    for t in tensors.values():
        stream.add(t)
    stream.finish()
    lo, hi = _address(ring.memory.numpy())
    # every copy lands in the ring (no host copy of a whole tensor anywhere else) ...
    assert all(lo <= a and b <= hi for a, b in copies.targets)
    assert {a for a, _ in copies.targets} >= {lo + i * (16 << 10) for i in range(4)}
    assert stream.bytes_written == sum(t.numel() * 4 for t in tensors.values())
    # ... never more blocks busy than the ring has, and no host memory beyond it was mapped
    assert stream.most_busy <= 4
    assert peak[0] <= mapped


def test_cancellation_is_seen_between_blocks_and_waits_for_the_copies_in_flight() -> None:
    tensors = _one_dtype()
    cancel = threading.Event()
    writer = LateReader()

    def write(data: Any) -> int:
        n = writer(data)
        if len(writer.calls) == 4:
            cancel.set()
        return n

    copies = ThreadCopies(delay_s=0.002)
    ring = StagingRing(2048, 4, copies=copies, stage_host_tensors=True)
    with pytest.raises(Cancelled):
        write_safetensors(write, tensors, cancel=cancel, ring=ring)
    assert len(writer.calls) == 4  # nothing written once cancelled
    assert copies.pending == 0  # no copy still writing into the ring


def test_a_failed_copy_is_raised_and_nothing_after_it_is_written() -> None:
    tensors = _one_dtype()
    writer = LateReader()
    copies = ThreadCopies(fail_at=5)
    ring = StagingRing(2048, 4, copies=copies, stage_host_tensors=True)
    with pytest.raises(RuntimeError, match="copy failed"):
        write_safetensors(writer, tensors, ring=ring)
    # the header and the blocks before the failed copy's block (copies 0-4 fill blocks 0-4)
    assert 1 <= len(writer.calls) <= 1 + 5
    assert copies.pending == 0


def test_a_failed_write_is_raised_after_the_copies_in_flight_end() -> None:
    calls = [0]

    def write(data: Any) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(28, "No space left on device")
        return len(memoryview(data))

    copies = ThreadCopies(delay_s=0.002)
    ring = StagingRing(2048, 4, copies=copies, stage_host_tensors=True)
    with pytest.raises(OSError, match="No space"):
        write_safetensors(write, _one_dtype(), ring=ring)
    assert calls[0] == 3 and copies.pending == 0


def test_a_finished_stream_gives_its_ring_back_and_a_failed_one_does_not() -> None:
    pool = StagingPool(kept=2)
    ring = StagingRing(4096, 3)
    stream = RingStream(ring, LateReader(), pool=pool)
    stream.add(torch.randn(5000))
    stream.finish()
    assert pool.idle_bytes == ring.nbytes  # back in the pool, reused by the next save

    failing = StagingPool(kept=2)
    calls = [0]

    def write(data: Any) -> int:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "I/O error")
        return len(memoryview(data))

    stream = RingStream(StagingRing(4096, 3), write, pool=failing)
    with pytest.raises(OSError):
        stream.add(torch.randn(5000))
        stream.finish()
    stream.abort()
    # the block handed to the failed call may still be read (a hash on a helper thread): the
    # ring is not reused; its memory goes once the writer lets go of it
    assert failing.idle_bytes == 0


def test_the_pool_reuses_rings_between_saves_and_keeps_at_most_two() -> None:
    pool = StagingPool(kept=2, block_bytes=4096, depth=4)
    a, b, c = pool.take(), pool.take(), pool.take()
    for ring in (a, b, c):
        pool.give(ring)
    assert pool.idle_bytes == 2 * 4096 * 4
    again = {id(pool.take()), id(pool.take())}
    assert again == {id(a), id(b)}  # the same memory, save after save
    pool.clear()
    assert pool.idle_bytes == 0


def test_host_tensors_keep_the_zero_copy_path() -> None:
    tensors = _one_dtype()
    seen: list[tuple[int, int]] = []

    def write(data: Any) -> int:
        view = memoryview(data)
        seen.append(_address(view))
        return len(view)

    write_safetensors(write, tensors)
    own = [(t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in tensors.values()]
    body = seen[1:]  # after the header: each tensor's own memory, nothing staged
    assert len(body) == len(tensors) and sorted(body) == sorted(own)


@pytest.mark.parametrize("kind", ["direct", "buffered", "memory"])
def test_real_writers_checksum_what_the_ring_hands_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # HashingWriter hashes blocks of 1 MiB or more on a helper thread and waits at its next
    # call; DirectFile copies into its own blocks: both must see every block as it was.
    # O_DIRECT is opt-in ($PREEMPTIBLE_DIRECT_IO=1 or checkpoint_direct_io); buffered: default
    monkeypatch.setenv("PREEMPTIBLE_DIRECT_IO", "1" if kind == "direct" else "0")
    url = "memory://ring-test/out" if kind == "memory" else str(tmp_path / "out")
    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(300_000 + i, generator=g) for i in range(6)}  # ~7 MB
    copies = ThreadCopies(delay_s=0.001)
    ring = StagingRing(1 << 20, 3, copies=copies, stage_host_tensors=True)
    store = Storage(url)
    with store.open_write("model.safetensors") as fh:
        write_safetensors(fh.write, tensors, {"format": "pt"}, ring=ring)
    expected = st_save(tensors, metadata={"format": "pt"})
    assert store.read_bytes("model.safetensors") == expected
    assert fh.size == len(expected)
    assert fh.digest == xxhash.xxh3_128(expected).hexdigest()


def test_host_buffers_are_exact_size_and_unmapped_once_unused() -> None:
    gc.collect()
    before = staging.held_bytes()["mapped"]
    nbytes = 172 << 20  # torch's pinned allocator would take 256 MiB (not touched here)
    buf = staging.host_buffer(nbytes + 5, pin=False)
    assert buf.numel() == nbytes + 5
    assert staging.held_bytes()["mapped"] - before == nbytes + 4096  # whole pages only
    view = buf[100:200]
    del buf
    gc.collect()
    assert staging.held_bytes()["mapped"] - before == nbytes + 4096  # a view keeps it
    view.fill_(7)
    del view
    gc.collect()
    assert staging.held_bytes()["mapped"] == before


def test_rings_refuse_a_depth_that_cannot_overlap() -> None:
    with pytest.raises(ValueError, match="depth >= 2"):
        StagingRing(4096, 1)
