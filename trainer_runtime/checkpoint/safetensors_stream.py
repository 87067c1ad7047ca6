"""safetensors files written as they are serialised, and read without extra copies.

The safetensors format is an 8-byte little-endian header length, a JSON header (padded with
spaces to a multiple of 8 bytes) naming each tensor's dtype, shape and byte range, then the raw
tensor bytes. :func:`write_safetensors` writes exactly that, one tensor after the other: a CPU
tensor straight from its own memory, a tensor on an accelerator through the bounded staging
ring of :mod:`~trainer_runtime.checkpoint.staging` (block by block, copied on a side CUDA stream
while the previous block is written). No whole-file buffer is ever built, so the extra host
memory of a save is the ring (128 MiB, reused between saves; CPU tensors: none). Tensors are
ordered as safetensors orders them (larger element size first, then by name), so every tensor
is aligned to its element size, and for a file of one dtype with at most one metadata key the
bytes are identical to ``safetensors.torch.save``'s. Any safetensors reader (``safe_open``,
``load_file``, ``from_pretrained``) opens the files.

:func:`read_into_buffer` reads a local file with large positional reads, on two threads, into
one host buffer (the tensors are views of it: one copy from the page cache, none afterwards),
handing each block to a callback in file order as soon as it is read (the checksum runs beside
the reading).
"""

from __future__ import annotations

import ctypes
import io
import json
import mmap
import os
import struct
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from trainer_runtime.checkpoint.direct_io import ALIGN, READ_REFUSED
from trainer_runtime.checkpoint.staging import RingStream, StagingRing, staging_pool
from trainer_runtime.errors import CheckpointError

__all__ = [
    "CHUNK_BYTES",
    "Cancelled",
    "TensorEntry",
    "TensorFile",
    "fault_in",
    "fault_in_alongside",
    "header_of",
    "plan",
    "read_header",
    "read_header_range",
    "read_into_buffer",
    "read_into_tensors",
    "tensor_entries",
    "tensors_from_buffer",
    "write_safetensors",
]

# Block size of writes and reads: large enough for full disk bandwidth, small enough that a
# cancellation is seen quickly and the hashing thread keeps pace.
CHUNK_BYTES = 64 << 20
# read_into_buffer: blocks read by READ_THREADS threads at once
READ_BLOCK_BYTES = 16 << 20
READ_THREADS = 2
# fault_in: pages faulted in per madvise call (a stop is seen between calls)
FAULT_IN_CHUNK = 32 << 20
# fault_in_alongside: CPUs a process needs before a helper faults in beside a read
FAULT_IN_MIN_CPUS = 2

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code
_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}


@dataclass(frozen=True)
class TensorFile:
    """A safetensors file still to be written: its tensors (any device) and metadata."""

    tensors: Mapping[str, torch.Tensor]
    metadata: Mapping[str, str] | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of its tensors (the file is this plus its header)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        """The whole file in memory (small files only: per-rank files held until a commit)."""
        out = io.BytesIO()
        write_safetensors(out.write, self.tensors, self.metadata)
        return out.getvalue()


class Cancelled(Exception):
    """The write was cancelled (a JIT save superseded a background save)."""


def plan(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    """The file's header (length prefix included) and the tensors in file order."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{name!r} is a {type(t).__name__}, not a tensor")
        if t.dtype not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has dtype {t.dtype}, which safetensors lacks")
        if t.layout != torch.strided:
            raise CheckpointError(f"tensor {name!r} is {t.layout}: only dense tensors are saved")
    ordered = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, t in ordered:
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def _host_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes as a memoryview of its memory (a copy only if not contiguous)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    flat = t.reshape(-1)
    if flat.element_size() != 1:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def write_safetensors(
    write: Callable[[Any], Any],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    cancel: threading.Event | None = None,
    ring: StagingRing | None = None,
) -> int:
    """Write a safetensors file through ``write`` (e.g. a HashingWriter's), tensor by tensor;
    returns the bytes written. ``cancel``: checked between blocks, raises :class:`Cancelled`.

    CPU tensors are handed to ``write`` as views of their own memory (the caller does not
    change them during the save). Tensors on an accelerator go through a staging ring (``ring``,
    else one of the process's :data:`~trainer_runtime.checkpoint.staging.staging_pool`), whose
    blocks ``write`` may read until its next call returns; when a ring was used, the last call
    is ``write(b"")`` (see :mod:`~trainer_runtime.checkpoint.staging`, the hand-over contract).
    """
    head, ordered = plan(tensors, metadata)

    def between_blocks() -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled()

    write(head)
    total = len(head)
    stream: RingStream | None = None
    try:
        for _name, t in ordered:
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            if t.device.type != "cpu" or (ring is not None and ring.stages(t)):
                if stream is None and ring is not None:
                    stream = RingStream(ring, write, between=between_blocks)
                elif stream is None:
                    stream = RingStream(
                        staging_pool.take(t.device),
                        write,
                        between=between_blocks,
                        pool=staging_pool,
                    )
                stream.add(t)
            else:
                if stream is not None:
                    stream.flush()  # the staged bytes come first in the file
                data = _host_bytes(t)
                for start in range(0, len(data), CHUNK_BYTES):
                    between_blocks()
                    write(data[start : start + CHUNK_BYTES])
            total += nbytes
        if stream is not None:
            stream.finish()
    except BaseException:
        if stream is not None:
            stream.abort()
        raise
    return total


def header_of(data: bytes | memoryview) -> tuple[dict[str, Any], int]:
    """The parsed header of a whole file held in memory, and where the tensor bytes start."""
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    return json.loads(bytes(data[8 : 8 + length])), 8 + length


def read_header(fh: BinaryIO) -> tuple[dict[str, Any], int]:
    """The parsed header of an open file (read from its start), and where the bytes start."""
    raw = fh.read(8)
    if len(raw) != 8:
        raise CheckpointError("not a safetensors file: shorter than 8 bytes")
    (length,) = struct.unpack("<Q", raw)
    if length > 100 << 20:
        raise CheckpointError(f"not a safetensors file: header length {length}")
    return json.loads(fh.read(length)), 8 + length


def read_header_range(
    read: Callable[[int, memoryview], None], *, limit: int = 100 << 20
) -> tuple[dict[str, Any], int]:
    """The parsed header of a file read through ``read(offset, dest)`` (ranged reads: the 8-byte
    length, then the JSON, nothing more), and where the tensor bytes start. CheckpointError
    when the bytes are not a safetensors header."""
    raw = bytearray(8)
    read(0, memoryview(raw))
    (length,) = struct.unpack("<Q", bytes(raw))
    if not 2 <= length <= limit:
        raise CheckpointError(f"not a safetensors file: header length {length}")
    text = bytearray(length)
    read(8, memoryview(text))
    try:
        header = json.loads(bytes(text))
    except ValueError as exc:
        raise CheckpointError(f"not a safetensors file: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError("not a safetensors file: its header is not a JSON object")
    return header, 8 + length


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a safetensors file lies: dtype, shape and its bytes ``[begin, end)``
    counted from the start of the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def tensor_entries(header: Mapping[str, Any], base: int) -> dict[str, TensorEntry]:
    """Every tensor of a parsed header (:func:`read_header_range`), checked for consistency:
    a known dtype, and a byte range exactly as long as its shape needs. CheckpointError
    otherwise."""
    out: dict[str, TensorEntry] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _BY_CODE[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            start, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"tensor {name!r} has a malformed header entry: {exc}") from exc
        numel = 1
        for n in shape:
            numel *= n
        itemsize = torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or start < 0 or end - start != numel * itemsize:
            raise CheckpointError(
                f"tensor {name!r}: bytes {start}-{end} do not hold shape {list(shape)} of "
                f"{entry['dtype']}"
            )
        out[name] = TensorEntry(dtype, shape, base + start, base + end)
    return out


_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python 3.11's mmap module
_libc: Any = None


def fault_in(
    buf: torch.Tensor, stop: threading.Event | None = None, *, chunk: int = FAULT_IN_CHUNK
) -> bool:
    """Fault the pages of ``buf`` (a contiguous CPU tensor) in, last chunk first, with
    ``madvise(MADV_POPULATE_WRITE)``, until done or ``stop`` is set; False where the kernel
    (before Linux 5.14) or libc refuses it: nothing was done, a later write faults the pages as
    it would have anyway.

    It never writes ``buf``'s bytes, so it may run on a helper thread while ``buf`` is being
    read into: a resume starts it while the model file is read, and the optimizer file is read
    into ``buf`` front to back while this thread works back to front, the two meeting in the
    middle. The first touch of fresh memory is what bounds copying a file into it (0.23-0.40 s
    for the 800 MB optimizer file of 100M parameters on the project's VM; paid on any Linux
    host, where every new page is zeroed on its first fault)."""
    if buf.numel() == 0:
        return True
    page = mmap.PAGESIZE
    lo = -(-buf.data_ptr() // page) * page  # madvise wants a page-aligned start
    end = (buf.data_ptr() + buf.numel() * buf.element_size()) // page * page
    chunk = max(page, chunk // page * page)
    hi = end
    while hi > lo:
        if stop is not None and stop.is_set():
            return True
        start = max(lo, hi - chunk)
        if not _madvise(start, hi - start, _MADV_POPULATE_WRITE):
            return False
        hi = start
    return True


def fault_in_alongside(cpus: int | None = None) -> bool:
    """Whether to fault a buffer in on a helper thread while another thread reads: only with
    at least :data:`FAULT_IN_MIN_CPUS` CPUs to run on (``cpus``; default: this process's
    affinity). The helper does the faults the read would do, in parallel, so it gains only
    with a second core (on the project's 2-core VM, shared with other jobs, it gained in the
    pooled cold-resume A/B and lost in one of its two runs; docs/checkpoints.md)."""
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    return cpus >= FAULT_IN_MIN_CPUS


def _madvise(addr: int, length: int, advice: int) -> bool:
    global _libc
    try:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise.restype = ctypes.c_int
            _libc = libc
        return bool(_libc.madvise(addr, length, advice) == 0)
    except (OSError, AttributeError):
        return False


def read_into_buffer(
    fh: BinaryIO,
    size: int,
    on_block: Callable[[memoryview], None] | None = None,
    *,
    threads: int = READ_THREADS,
    out: torch.Tensor | None = None,
    direct_fd: int | None = None,
) -> torch.Tensor:
    """Read ``size`` bytes of the file ``fh`` (from its current position) into one new uint8
    tensor (or ``out``: a contiguous uint8 CPU tensor of exactly ``size`` bytes, e.g. one
    :func:`fault_in` is faulting in on another thread), calling ``on_block`` (on the calling
    thread) with each block in file order as soon as it and every block before it are read.

    ``threads`` threads read blocks at once, each with positional reads into its own part of
    the buffer. Copying from the page cache into fresh memory is bound by first touching that
    memory (this VM faults every new page in the host too), and two threads fault in parallel:
    an 800 MB optimizer file read in 0.29-0.33 s with two threads, 0.56-0.62 s with one.

    ``direct_fd``: the same file opened with ``O_DIRECT`` (:func:`direct_read.open_direct`):
    each block's whole pages are read through it, straight from the disk into the buffer (no
    page-cache copy), where the buffer and the file position are page-aligned; a partial last
    page goes through ``fh``, and so does everything from the first request the filesystem
    refuses (``EINVAL``, ``EOPNOTSUPP``) on. The bytes and the blocks handed to ``on_block``
    are the same either way.
    """
    if out is not None:
        if (
            out.dtype != torch.uint8
            or out.device.type != "cpu"
            or not out.is_contiguous()
            or out.numel() != size
        ):
            raise ValueError(f"out must be a contiguous uint8 CPU tensor of {size} bytes")
        buf = out
    else:
        buf = torch.empty(size, dtype=torch.uint8)
    view = memoryview(buf.numpy()).cast("B")
    start = fh.tell()
    fd = fh.fileno()

    # O_DIRECT wants the buffer, the file offset and the length page-aligned
    direct = [
        direct_fd is not None
        and buf.data_ptr() % ALIGN == 0
        and start % ALIGN == 0
        and READ_BLOCK_BYTES % ALIGN == 0
    ]

    def read(lo: int, hi: int) -> None:
        done = lo
        while done < hi:
            whole = (hi - done) // ALIGN * ALIGN
            n = None
            if direct[0] and whole and done % ALIGN == 0:
                assert direct_fd is not None
                try:
                    n = os.preadv(direct_fd, [view[done : done + whole]], start + done)
                except OSError as exc:
                    if exc.errno not in READ_REFUSED:
                        raise
                    direct[0] = False  # this and every later request: through the page cache
            if n is None:
                n = os.preadv(fd, [view[done:hi]], start + done)
            if not n:
                raise CheckpointError(f"file ended after {done} of {size} bytes")
            done += n

    blocks = [(lo, min(lo + READ_BLOCK_BYTES, size)) for lo in range(0, size, READ_BLOCK_BYTES)]
    if threads <= 1 or len(blocks) < 2:
        for lo, hi in blocks:
            read(lo, hi)
            if on_block is not None:
                on_block(view[lo:hi])
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-read") as pool:
            futures = [pool.submit(read, lo, hi) for lo, hi in blocks]
            try:
                for (lo, hi), future in zip(blocks, futures, strict=True):
                    future.result()
                    if on_block is not None:
                        on_block(view[lo:hi])
            except BaseException:
                for future in futures:
                    future.cancel()  # the pool's exit waits for the reads already running
                raise
    fh.seek(start + size)
    return buf


def _fits(dest: torch.Tensor | None, entry: TensorEntry) -> bool:
    """Whether the file's bytes of ``entry`` can be read straight into ``dest``'s memory: a
    plain dense CPU tensor of the same dtype and shape, laid out contiguously."""
    return (
        dest is not None
        and type(dest) in (torch.Tensor, torch.nn.Parameter)
        and dest.layout == torch.strided
        and dest.device.type == "cpu"
        and dest.dtype == entry.dtype
        and tuple(dest.shape) == entry.shape
        and dest.is_contiguous()
        and not dest.is_conj()
        and not dest.is_neg()
        and dest.numel() * dest.element_size() == entry.end - entry.begin
    )


def read_into_tensors(
    fd: int,
    size: int,
    into: Mapping[str, torch.Tensor],
    on_block: Callable[[memoryview], None] | None = None,
    *,
    block: int = READ_BLOCK_BYTES,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a whole safetensors file (``size`` bytes of ``fd``) in one sequential pass, each
    tensor's bytes straight into the tensor of the same name in ``into`` where it fits
    (:func:`_fits`: same dtype and shape, contiguous, on the CPU), else into a new tensor.

    Returns the header and every tensor of the file by name (the ``into`` tensor itself where it
    was read into). ``on_block`` gets every byte of the file once, in file order (header, tensor
    bytes, any gap or tail), e.g. a checksum. The reads are large and in order, so a cold file
    streams at the disk's rate through the kernel's readahead, and no page of fresh memory is
    touched for a tensor that has a destination (a memory-mapped file is faulted in page by
    page and then copied). A tensor named twice in ``into`` through tied storage is written
    twice with the same bytes.
    """
    if size < 8:
        raise CheckpointError("not a safetensors file: shorter than 8 bytes")

    def read(offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done : done + block]], offset + done)
            if not n:
                raise CheckpointError(f"file ended at byte {offset + done} of {size}")
            if on_block is not None:
                on_block(view[done : done + n])
            done += n

    header, base = read_header_range(read, limit=min(100 << 20, size - 8))
    entries = sorted(tensor_entries(header, base).items(), key=lambda kv: kv[1].begin)
    out: dict[str, torch.Tensor] = {}
    pos = base
    for name, entry in entries:
        if entry.begin < pos:
            raise CheckpointError(f"tensor {name!r} overlaps the tensor before it")
        if entry.end > size:
            raise CheckpointError(f"tensor {name!r} ends at byte {entry.end}, after the file")
        if entry.begin > pos:  # a gap: read (and passed to on_block) but not kept
            read(pos, memoryview(bytearray(entry.begin - pos)))
        dest = into.get(name)
        if not _fits(dest, entry):
            dest = torch.empty(entry.shape, dtype=entry.dtype)
        assert dest is not None
        if entry.end > entry.begin:
            with torch.no_grad():
                flat = dest.detach().reshape(-1).view(torch.uint8)
            read(entry.begin, memoryview(flat.numpy()).cast("B"))
        out[name] = dest
        pos = entry.end
    if pos < size:  # bytes after the last tensor: part of the file (and of its checksum)
        read(pos, memoryview(bytearray(size - pos)))
    return header, out


def tensors_from_buffer(
    buf: torch.Tensor, header: Mapping[str, Any], base: int
) -> dict[str, torch.Tensor]:
    """The tensors of a whole file read into ``buf``, as views of it (no copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _BY_CODE.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"tensor {name!r} has an unknown dtype {entry['dtype']!r}")
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        raw = buf[base + start : base + end]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if (base + start) % itemsize:
            raw = raw.clone()  # a misaligned writer's file: views need aligned offsets
        if dtype == torch.bool:
            t = raw.view(torch.bool)
        elif raw.numel() == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = raw.view(dtype)
        out[name] = t.reshape(shape)
    return out
