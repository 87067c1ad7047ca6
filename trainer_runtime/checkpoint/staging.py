"""Host memory for device-to-host copies: exact-size pinned buffers and the staging ring.

**Exact-size host memory** (:func:`host_buffer`). torch's pinned memory (``pin_memory=True``)
comes from its caching host allocator, which rounds every block up to a power of two (a
172 MiB tensor takes 256 MiB) and keeps freed blocks cached (torch 2.15's
``pinned_max_round_threshold`` and ``pinned_max_cached_size`` change that, but only for the whole
process, through ``PYTORCH_CUDA_ALLOC_CONF``). Our buffers are
anonymous mappings rounded up to whole pages only, registered with ``cudaHostRegister``
(through ``torch.cuda.cudart()``) when pinned, unregistered and unmapped as soon as the last
tensor viewing them is gone. :func:`held_bytes` counts them (torch's
``torch.cuda.host_memory_stats()`` does not see them).

**The staging ring** (:class:`StagingRing`, :class:`RingStream`). A tensor on an accelerator
reaches the file through :data:`DEPTH` host blocks of :data:`BLOCK_BYTES` (one pinned mapping):
once the device's queued work is done (a file's first copy waits for it), its bytes, and those
of the tensors after it in file order, are copied block by block on a side CUDA stream
(``copy_(non_blocking=True)``, one event per block), and block k is handed to ``write`` while
blocks k+1 and k+2 are being copied. Never more than the ring is in flight,
whatever the size of the state. Rings are kept for the life of the process
(:data:`staging_pool`: one per file being written at once, at most :data:`KEPT_RINGS` kept).

**The hand-over contract.** ``write(block)`` may go on reading ``block`` until its *next* call
returns (``HashingWriter`` hashes a block on a helper thread and waits for that hash at its next
call; ``DirectFile`` copies each block into its own staging blocks before returning; files and
``BytesIO`` copy). So a block handed over is reused only after a later ``write`` returned, and a
stream ends with one ``write(b"")`` (it writes nothing) after its last block, so that no block
is in use once the stream is finished. A stream that fails (an error, a cancellation) waits for
its copies in flight and, if its last block may still be read, does not return its ring to the
pool: the memory goes when the writer lets go of it.

Devices other than CUDA are copied synchronously into unpinned blocks; the copies, the ring and
the contract are the same, so everything also runs (and is tested) on the CPU.

**On the tensor's device** (:func:`on_device`). Writer, hashing and pin-ahead threads have no
current device of their own: CUDA would take device 0, and the first call there (a
``cudaHostRegister``, an event, an unregister when the last view of a buffer goes) would create a
context on GPU 0 (0.3-0.5 GiB per process: 7 of them on an 8-GPU node's GPU 0 at the JIT
moment). So every CUDA call made here runs under ``on_device(<the tensor's device>)``: pinning
and unpinning (each buffer remembers the device it was pinned for), copies, streams, events.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

__all__ = [
    "BLOCK_BYTES",
    "DEPTH",
    "KEPT_RINGS",
    "CopyEngine",
    "CudaCopies",
    "HeldBytes",
    "RingStream",
    "StagingPool",
    "StagingRing",
    "SyncCopies",
    "copies_for",
    "flat_bytes",
    "held_bytes",
    "host_buffer",
    "on_device",
    "staging_pool",
    "stream_tensors",
]

logger = logging.getLogger(__name__)

# A block is one DMA request and one ``write`` call. 32 MiB: PCIe copies reach their plateau
# from a few MiB, so per-block costs (a copy launch, an event, a Python round of the loop: tens
# of microseconds) stay about 1% of a block's 0.6 ms at 50 GB/s; a disk writes it in 5-30 ms,
# so cancellation is still seen within milliseconds. It is a multiple of DirectFile's 4 MiB
# staging blocks and of every page size.
BLOCK_BYTES = 32 << 20
# Blocks per ring: one handed to ``write`` (possibly still read until the next call), one being
# filled, two copying ahead. 4 x 32 MiB = 128 MiB of pinned memory per file written at once.
DEPTH = 4
# Rings kept between saves: the Trainer writes its two large files (model, optimizer) at once.
KEPT_RINGS = 2

_PAGE = mmap.PAGESIZE


# -- the CUDA device of helper threads ----------------------------------------------------------
def _cuda_device(index: int) -> contextlib.AbstractContextManager[Any]:
    """The one place a thread's current CUDA device is set (a seam for the CPU tests)."""
    return torch.cuda.device(index)


def _cudart() -> Any:
    """The CUDA runtime calls made here directly (a seam for the CPU tests)."""
    return torch.cuda.cudart()


def on_device(device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """Run the block with ``device`` as this thread's current CUDA device; a no-op for
    ``None`` and devices other than CUDA (a device without an index: the current one)."""
    if device is None or device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    return _cuda_device(device.index)


# -- exact-size host memory ------------------------------------------------------------------------
_held_lock = threading.Lock()
_held = {"mapped": 0, "pinned": 0}
_pin_warned = False


class HeldBytes:
    """A thread-safe count of the bytes of :func:`host_buffer` buffers still alive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self, delta: int) -> None:
        with self._lock:
            self._value += delta

    @property
    def value(self) -> int:
        with self._lock:
            return self._value


class _Mapping(mmap.mmap):
    """Anonymous memory; unregistered from CUDA (when pinned) before it is unmapped.

    A tensor made with ``torch.frombuffer`` keeps this object alive, so it is only unmapped
    once no tensor (and no view of one) uses the memory."""

    pinned_ptr: int = 0
    counted: int = 0
    account: HeldBytes | None = None
    # the device it was pinned for: the last view may go on any thread (a writer's)
    device: torch.device | None = None

    def __del__(self) -> None:
        ptr, self.pinned_ptr = self.pinned_ptr, 0
        if ptr:
            with contextlib.suppress(Exception), on_device(self.device):
                # (interpreter shutdown: CUDA may be gone)
                _cudart().cudaHostUnregister(ptr)
            _count("pinned", -self.counted)
        if self.counted:
            _count("mapped", -self.counted)
            if self.account is not None:
                self.account.add(-self.counted)
            self.counted = 0


def _count(kind: str, delta: int) -> None:
    with _held_lock:
        _held[kind] += delta


def held_bytes() -> dict[str, int]:
    """Host memory of :func:`host_buffer` now held in this process: ``mapped`` (all of it)
    and ``pinned`` (the part registered with CUDA)."""
    with _held_lock:
        return dict(_held)


def _can_pin() -> bool:
    return torch.cuda.is_available()


def host_buffer(
    nbytes: int,
    *,
    pin: bool,
    account: HeldBytes | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of fresh host memory: an anonymous mapping rounded up to
    whole pages only, registered with CUDA (``cudaHostRegister``) when ``pin`` and CUDA is
    available. The memory goes back to the OS when the tensor and every view of it are gone.

    ``device``: the CUDA device the buffer serves; registering and unregistering run on it
    (:func:`on_device`; None: the calling thread's current device). If registering fails, the
    buffer stays unpinned (copies into it are then synchronous) and a warning is logged once.
    ``account`` counts the buffer's bytes while it is alive."""
    global _pin_warned
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    size = -(-nbytes // _PAGE) * _PAGE
    mapping = _Mapping(-1, size)
    mapping.counted = size
    _count("mapped", size)
    if account is not None:
        mapping.account = account
        account.add(size)
    buf = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    if pin and _can_pin():
        ptr = buf.data_ptr()
        with on_device(device):
            # 1 = cudaHostRegisterPortable: pinned for every CUDA context of the process
            err = int(_cudart().cudaHostRegister(ptr, size, 1))
        if err == 0:
            mapping.device = device
            mapping.pinned_ptr = ptr
            _count("pinned", size)
        elif not _pin_warned:
            _pin_warned = True
            logger.warning(
                "cudaHostRegister of %d bytes failed (cudaError %d): checkpoint copies from the "
                "GPU use unpinned host memory (synchronous, slower)",
                size,
                err,
            )
    return buf


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a contiguous 1-D uint8 tensor on its own device (a copy on the
    device only when it is not contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.reshape(-1)
    return flat if flat.element_size() == 1 else flat.view(torch.uint8)


# -- copies --------------------------------------------------------------------------------------
class CopyEngine(Protocol):
    """Copies into host memory that complete in the order they were queued."""

    def start(self, device: torch.device) -> None:
        """Before the first copy from ``device`` of a file or snapshot: make the copies see
        every write queued on the device so far, by any thread on any stream."""

    def order_after_queued_work(self, device: torch.device) -> None:
        """Make later copies from ``device`` see the work already queued there (the kernels
        that wrote the tensors, a ``contiguous()`` copy)."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue a copy of ``src`` into the host tensor ``dst`` (same number of bytes)."""

    def mark(self, device: torch.device) -> Callable[[], None]:
        """A function that waits (and raises any error) until every copy from ``device``
        queued so far is done."""


def _done() -> None:
    return None


class SyncCopies:
    """Plain, synchronous copies (the CPU; devices without streams)."""

    def start(self, device: torch.device) -> None:
        return None

    def order_after_queued_work(self, device: torch.device) -> None:
        return None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def mark(self, device: torch.device) -> Callable[[], None]:
        return _done


class CudaCopies:
    """Copies on one side stream per device, so they overlap the compute stream's work and
    the file writes; each :meth:`mark` records an event."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            side = self._streams.get(index)
            if side is None:
                side = self._streams[index] = torch.cuda.Stream(device=index)
        return side

    def start(self, device: torch.device) -> None:
        # The tensors may have been written on another thread's stream (a writer thread's
        # current stream is the default one, training may use its own): wait for the device.
        # A save starts at a step boundary, where there is little left to wait for.
        with on_device(device):
            torch.cuda.synchronize(device)

    def order_after_queued_work(self, device: torch.device) -> None:
        with on_device(device):
            self.stream(device).wait_stream(torch.cuda.current_stream(device))

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with on_device(src.device), torch.cuda.stream(self.stream(src.device)):
            dst.copy_(src, non_blocking=True)

    def mark(self, device: torch.device) -> Callable[[], None]:
        # blocking: the waiting thread sleeps instead of spinning on a core that the hashing
        # and I/O threads of the same save need
        with on_device(device):
            event = torch.cuda.Event(blocking=True)
            event.record(self.stream(device))

        def wait() -> None:
            with on_device(device):
                event.synchronize()

        return wait


_sync_copies = SyncCopies()
_cuda_copies: CudaCopies | None = None
_cuda_lock = threading.Lock()


def copies_for(device: torch.device) -> CopyEngine:
    """The process's copy engine for tensors on ``device``."""
    global _cuda_copies
    if device.type != "cuda":
        return _sync_copies
    with _cuda_lock:
        if _cuda_copies is None:
            _cuda_copies = CudaCopies()
        return _cuda_copies


# -- the ring --------------------------------------------------------------------------------------
class StagingRing:
    """``depth`` host blocks of ``block_bytes`` (one mapping; pinned when ``pin`` and CUDA is
    available). One :class:`RingStream` uses a ring at a time.

    ``copies``: the copy engine for every tensor (default: :func:`copies_for` its device).
    ``stage_host_tensors``: CPU tensors go through the ring as well (tests; benchmarks).
    ``device``: the CUDA device whose tensors it stages (its memory is pinned there; pinned
    portable, so it serves every device of the process afterwards).
    """

    def __init__(
        self,
        block_bytes: int = BLOCK_BYTES,
        depth: int = DEPTH,
        *,
        pin: bool | None = None,
        copies: CopyEngine | None = None,
        stage_host_tensors: bool = False,
        device: torch.device | None = None,
    ) -> None:
        if block_bytes <= 0 or depth < 2:
            raise ValueError(f"a staging ring needs block_bytes > 0 and depth >= 2, not {depth}")
        self.block_bytes = block_bytes
        self.depth = depth
        self.copies = copies
        self.stage_host_tensors = stage_host_tensors
        self.pin = _can_pin() if pin is None else pin
        self.device = device
        self.memory = host_buffer(block_bytes * depth, pin=self.pin, device=device)
        self.blocks = [self.memory[i * block_bytes : (i + 1) * block_bytes] for i in range(depth)]
        # one memoryview per block, sliced for each hand-over (no numpy call per block)
        self.views = [memoryview(b.numpy()) for b in self.blocks]

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.depth

    @property
    def pinned(self) -> bool:
        if not _can_pin():
            return False
        with on_device(self.device):
            return self.memory.is_pinned()

    def stages(self, t: torch.Tensor) -> bool:
        """Whether ``t`` goes through the ring (every tensor off the CPU)."""
        return t.device.type != "cpu" or self.stage_host_tensors

    def engine(self, device: torch.device) -> CopyEngine:
        return self.copies if self.copies is not None else copies_for(device)


class StagingPool:
    """The process's rings, reused between saves: a writer takes one, gives it back when its
    stream is finished. At most ``kept`` idle rings are kept (the rest are unmapped)."""

    def __init__(
        self, kept: int = KEPT_RINGS, *, block_bytes: int = BLOCK_BYTES, depth: int = DEPTH
    ) -> None:
        self.kept = kept
        self.block_bytes = block_bytes
        self.depth = depth
        self._idle: list[StagingRing] = []
        self._lock = threading.Lock()

    def take(self, device: torch.device | None = None) -> StagingRing:
        """An idle ring, else a new one pinned on ``device`` (the first tensor's it stages)."""
        pin = _can_pin()
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return StagingRing(self.block_bytes, self.depth, pin=pin, device=device)

    def give(self, ring: StagingRing) -> None:
        with self._lock:
            if len(self._idle) < self.kept:
                self._idle.append(ring)

    def clear(self) -> None:
        """Drop every idle ring (their memory goes back to the OS)."""
        with self._lock:
            self._idle.clear()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._idle)


staging_pool = StagingPool()


class RingStream:
    """Writes the bytes of tensors, in order, through a ring's blocks to ``write``.

    :meth:`add` queues a tensor's copies (block by block; a block may hold the end of one
    tensor and the start of the next); a block is handed to ``write`` once its copies are done,
    as the ring needs its memory back, and :meth:`flush` writes everything queued. ``between``
    is called before each block is written (e.g. raises on cancellation). End with
    :meth:`finish` (success: the last ``write(b"")``, the ring back to its pool) or
    :meth:`abort` (after an error: waits for the copies in flight).
    """

    def __init__(
        self,
        ring: StagingRing,
        write: Callable[[Any], Any],
        *,
        between: Callable[[], None] | None = None,
        pool: StagingPool | None = None,
    ) -> None:
        self.ring = ring
        self._write = write
        self._between = between
        self._pool = pool
        self._free: deque[int] = deque(range(ring.depth))
        # blocks whose copies are queued, in file order: (block, bytes, waits)
        self._sealed: deque[tuple[int, int, list[Callable[[], None]]]] = deque()
        # blocks handed to ``write`` that it may still read: the last call's block, and while
        # a call has not returned (or raised), the one before it too
        self._handed: list[int] = []
        self._filling: int | None = None
        self._fill = 0
        self._sources: list[list[torch.Tensor]] = [[] for _ in range(ring.depth)]
        self._engines: list[dict[torch.device, CopyEngine]] = [{} for _ in range(ring.depth)]
        self._started: set[torch.device] = set()
        self._closed = False
        self.blocks_written = 0
        self.bytes_written = 0
        # most blocks busy at once (queued, being filled or handed over): never above depth
        self.most_busy = 0

    # -- queueing copies ------------------------------------------------------------------------
    def add(self, t: torch.Tensor) -> None:
        device = t.device
        engine = self.ring.engine(device)
        if device not in self._started:
            engine.start(device)
            self._started.add(device)
        was_contiguous = t.is_contiguous()
        src = flat_bytes(t)
        if not was_contiguous:
            engine.order_after_queued_work(device)  # the contiguous() copy just queued
        size = self.ring.block_bytes
        pos, n = 0, src.numel()
        while pos < n:
            block = self._filling_block()
            take = min(n - pos, size - self._fill)
            engine.copy(
                self.ring.blocks[block][self._fill : self._fill + take], src[pos : pos + take]
            )
            # the source stays referenced until its copies are waited for (a contiguous()
            # temporary on the device must not be reused while the side stream reads it)
            if not self._sources[block] or self._sources[block][-1] is not src:
                self._sources[block].append(src)
            self._engines[block][device] = engine
            self._fill += take
            pos += take
            if self._fill == size:
                self._seal()

    def _filling_block(self) -> int:
        if self._filling is None:
            while not self._free:
                self._write_oldest()
            self._filling = self._free.popleft()
            self._fill = 0
            busy = self.ring.depth - len(self._free)
            self.most_busy = max(self.most_busy, busy)
        return self._filling

    def _seal(self) -> None:
        block, nbytes = self._filling, self._fill
        assert block is not None
        waits = [engine.mark(device) for device, engine in self._engines[block].items()]
        self._engines[block] = {}
        self._sealed.append((block, nbytes, waits))
        self._filling = None
        self._fill = 0

    # -- handing blocks to write ------------------------------------------------------------
    def _write_oldest(self) -> None:
        block, nbytes, waits = self._sealed[0]
        if self._between is not None:
            self._between()
        for wait in waits:
            wait()
        self._sealed.popleft()
        self._sources[block] = []  # copied: the device tensors may go
        self._handed.append(block)
        self._write(self.ring.views[block][:nbytes])
        self.blocks_written += 1
        self.bytes_written += nbytes
        # the contract: what the earlier calls were given is no longer read once this returned
        self._free.extend(self._handed[:-1])
        del self._handed[:-1]

    def flush(self) -> None:
        """Write every byte queued so far (e.g. before a host tensor's bytes are written)."""
        if self._filling is not None and self._fill:
            self._seal()
        while self._sealed:
            self._write_oldest()

    def finish(self) -> None:
        """Write the rest; after the last ``write(b"")`` no block is in use: the ring goes
        back to its pool."""
        self.flush()
        if self._handed:
            self._write(b"")
            self._free.extend(self._handed)
            self._handed.clear()
        self._close(reusable=True)

    def abort(self) -> None:
        """After an error: wait for the copies in flight (their errors are dropped: the
        caller's error is the one that counts). The ring goes back to its pool only if no block
        may still be read by the writer."""
        for _block, _nbytes, waits in self._sealed:
            for wait in waits:
                with contextlib.suppress(Exception):
                    wait()
        if self._filling is not None:
            for device, engine in self._engines[self._filling].items():
                with contextlib.suppress(Exception):
                    engine.mark(device)()
        self._sealed.clear()
        self._close(reusable=not self._handed)

    def _close(self, *, reusable: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._sources = [[] for _ in range(self.ring.depth)]
        if reusable and self._pool is not None:
            self._pool.give(self.ring)


def stream_tensors(
    write: Callable[[Any], Any],
    tensors: Iterable[torch.Tensor],
    *,
    ring: StagingRing | None = None,
    between: Callable[[], None] | None = None,
) -> int:
    """Write the bytes of ``tensors`` (every one staged) through a ring; returns the bytes.
    A convenience for benchmarks and tests; ``write_safetensors`` drives :class:`RingStream`
    itself."""
    pool = None if ring is not None else staging_pool
    stream = RingStream(ring or staging_pool.take(), write, between=between, pool=pool)
    try:
        for t in tensors:
            stream.add(t)
        stream.finish()
    except BaseException:
        stream.abort()
        raise
    return stream.bytes_written
