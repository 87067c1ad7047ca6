"""Asynchronous periodic checkpoints (``save_async``): a snapshot at the step boundary, a writer
thread, the commit back on the training thread.

The protocol is the ordinary one (sentinel first, files fsynced, manifest last), split in time:

1. at the step boundary, on every rank: ``writer.begin()`` (the sentinel, a barrier), then the
   state is snapshotted (:func:`snapshot_entry`: tensors copied to host memory, records built
   now) - this is all training waits for;
2. a :class:`BackgroundSave` thread writes this rank's files (no collective on that thread);
3. at a later step boundary, when every rank's thread is done (the ranks agree through one
   all-reduce per step while a write is in flight), the training thread calls
   ``writer.commit()``: the ranks' records, a barrier, the manifest (the commit point).

At most one write is in flight. A JIT stop cancels it (the writer stops between blocks; its
directory keeps its sentinel, so resume skips it and rotation removes it) unless it is of the
JIT step itself, which is then waited for and committed. A process killed during the write
leaves the same incomplete directory.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from trainer_runtime.checkpoint.safetensors_stream import Cancelled, TensorFile
from trainer_runtime.checkpoint.staging import CopyEngine, HeldBytes, copies_for, host_buffer
from trainer_runtime.errors import ConfigurationError

__all__ = [
    "BackgroundSave",
    "SnapshotBuffers",
    "json_bytes",
    "resolve_save_async",
    "snapshot_entry",
]

logger = logging.getLogger(__name__)


def json_bytes(obj: Any) -> bytes:
    """A JSON file of a checkpoint, as the writer's ``write_json`` writes it."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")


# Each tensor of a pinned snapshot starts on a page of its file's mapping: aligned for any dtype
# and for DMA; it costs under 4 KiB a tensor (at most 3.5 MB for a 7B model's weights and AdamW
# state, 873 tensors).
_ALIGN = 4096


class SnapshotBuffers:
    """Host memory the state is copied into at each background save.

    Sizes are exact (never rounded up to a power of two). A file's tensors on a CUDA device are
    copied into views of one mapping pinned with ``cudaHostRegister``
    (:func:`~trainer_runtime.checkpoint.staging.host_buffer`; each tensor page-aligned), on a
    side stream at full speed, then one wait; CPU tensors into ordinary memory from torch's
    CPU allocator, one block per tensor. Memory is bounded by the entries this rank snapshots.

    ``keep`` (decided by :class:`~trainer_runtime.checkpoint.pinned.PinnedStaging` from
    ``TrainingArguments.save_async_keep_snapshot`` and the host memory left):

    * ``False``: nothing is kept here; a buffer lives as long as the snapshot's tensors, which
      :class:`BackgroundSave` drops once this rank's files are written: pinned buffers are
      unpinned and unmapped, CPU buffers freed to the allocator (where training reuses them;
      under the Trainer's CPU allocator settings the heap keeps them, so the next snapshot
      finds them resident) before the next save. :meth:`prepare` pins the next snapshot's
      memory ahead of it (the pin-ahead mode; used once);
    * ``True``: each file's buffer is kept and reused by the next snapshot of the same file
      when the tensors' names, dtypes and shapes are the same (at most one write is in flight,
      so it is free by then): later snapshots are a plain copy into warm memory, for a copy of
      the state held (pinned, for GPU tensors) for the whole run.

    ``reused`` / ``allocated`` count the groups copied into memory allocated before / by their
    snapshot.
    """

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self._kept: dict[tuple[str, bool], tuple[tuple[Any, ...], list[torch.Tensor]]] = {}
        # pinned ahead of the next snapshot (pin-ahead, checkpoint/pinned.py): used once
        self._prepared: dict[tuple[str, bool], tuple[tuple[Any, ...], list[torch.Tensor]]] = {}
        # each pinned group's last layout and device: what :meth:`prepare` pins
        self._layouts: dict[tuple[str, bool], tuple[tuple[Any, ...], torch.device]] = {}
        self._lock = threading.Lock()  # prepare() runs on a side thread
        self._stop_preparing = threading.Event()
        self._held = HeldBytes()
        # groups (a file's CUDA tensors, or its CPU tensors) copied into memory allocated
        # before the snapshot (kept or pinned ahead), and into memory allocated by it
        self.reused = 0
        self.allocated = 0
        # seconds the last snapshot spent allocating (and pinning) its memory
        self.allocate_seconds = 0.0

    def snapshot(self, name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` (the file ``name``) in host memory: views of one pinned mapping
        for the CUDA tensors, one block each for the others."""
        out: dict[str, torch.Tensor] = {}
        groups: dict[bool, list[tuple[str, torch.Tensor]]] = {}
        for key, t in tensors.items():
            t = t.detach()
            if t.numel() == 0:
                out[key] = torch.empty(t.shape, dtype=t.dtype)
                continue
            groups.setdefault(t.device.type == "cuda", []).append((key, t))
        for pinned, items in groups.items():
            out.update(self._copy_group(name, pinned, items))
        return {key: out[key] for key in tensors}

    def _copy_group(
        self, name: str, pinned: bool, items: list[tuple[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        group = (name, pinned)
        layout = tuple((key, t.dtype, tuple(t.shape)) for key, t in items)
        device = items[0][1].device
        with self._lock:
            ready = self._kept.get(group)
            prepared = self._prepared.pop(group, None)
            if ready is None or ready[0] != layout:
                ready = prepared
            if pinned:
                self._layouts[group] = (layout, device)
        if ready is not None and ready[0] == layout:
            dests = ready[1]
            self.reused += 1
        else:
            started = time.perf_counter()
            dests = self._pinned_views(layout, device) if pinned else self._pageable(items)
            self.allocate_seconds += time.perf_counter() - started
            self.allocated += 1
        if self.keep:
            with self._lock:
                self._kept[group] = (layout, dests)
        engines: dict[torch.device, CopyEngine] = {}
        for (_key, t), dest in zip(items, dests, strict=True):
            engine = engines.get(t.device)
            if engine is None:
                engine = engines[t.device] = copies_for(t.device)
                engine.start(t.device)
            engine.copy(dest, t)
        waits = [engine.mark(device) for device, engine in engines.items()]
        for wait in waits:
            wait()  # training may change the tensors once this returns
        return {key: dest for (key, _t), dest in zip(items, dests, strict=True)}

    def _pinned_views(self, layout: tuple[Any, ...], device: torch.device) -> list[torch.Tensor]:
        """Views of one pinned mapping of the group's exact size (each tensor page-aligned):
        one registration per file, not one pinned block per tensor; registered on ``device``
        (the group's first tensor's), whichever thread asks."""
        offsets: list[int] = []
        sizes: list[int] = []
        total = 0
        for _key, dtype, shape in layout:
            nbytes = math.prod(shape) * dtype.itemsize
            offsets.append(total)
            sizes.append(nbytes)
            total += -(-nbytes // _ALIGN) * _ALIGN
        buf = host_buffer(total, pin=True, account=self._held, device=device)
        return [
            buf[offset : offset + nbytes].view(dtype).reshape(shape)
            for (_key, dtype, shape), offset, nbytes in zip(layout, offsets, sizes, strict=True)
        ]

    def prepare(self) -> int:
        """Pin, now, the memory of the next snapshot of every file of CUDA tensors snapshotted
        before (same layout), unless it is kept or prepared already: the pin-ahead mode runs
        this on a side thread in the steps before a save. Returns the bytes pinned."""
        with self._lock:
            todo = [
                (group, layout, device)
                for group, (layout, device) in self._layouts.items()
                if group not in self._prepared
                and (group not in self._kept or self._kept[group][0] != layout)
            ]
        self._stop_preparing.clear()
        before = self._held.value
        for group, layout, device in todo:
            if self._stop_preparing.is_set():
                break
            dests = self._pinned_views(layout, device)
            with self._lock:
                if self._stop_preparing.is_set():
                    break  # given back (a JIT stop) while this group was being pinned
                self._prepared[group] = (layout, dests)
        return self._held.value - before

    def stop_preparing(self) -> None:
        """Make a :meth:`prepare` in progress stop after its current group and keep nothing
        (it does not wait for it)."""
        self._stop_preparing.set()

    @property
    def pinned_layout_bytes(self) -> int:
        """Bytes of the last snapshot's CUDA tensors (what keeping or pinning ahead holds)."""
        with self._lock:
            return sum(
                math.prod(shape) * dtype.itemsize
                for layout, _device in self._layouts.values()
                for _key, dtype, shape in layout
            )

    def _pageable(self, items: list[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """One allocation per tensor from torch's CPU allocator (exact sizes): blocks of the
        gradients' sizes reuse what training freed, where one large block needs fresh pages
        (the first snapshot of a 100M-parameter CPU run, medians of 6 alternating runs: 0.60 s
        with a block per tensor, 0.84 s with one block per file)."""
        dests = []
        for _key, t in items:
            dest = torch.empty(t.shape, dtype=t.dtype)
            nbytes = t.numel() * t.element_size()
            self._held.add(nbytes)
            # a storage's Python object lives as long as the storage (views included)
            weakref.finalize(dest.untyped_storage(), self._held.add, -nbytes)
            dests.append(dest)
        return dests

    def copy(self, key: tuple[str, str], t: torch.Tensor) -> torch.Tensor:
        """One tensor's snapshot (its own buffer; kept under ``key`` when ``keep``)."""
        return self.snapshot("\0".join(key), {key[1]: t})[key[1]]

    @property
    def held_bytes(self) -> int:
        """Bytes of this object's buffers still alive (kept, or held by a write in flight)."""
        return self._held.value

    def clear(self) -> None:
        """Drop the kept and prepared buffers (their memory goes once no write uses them)."""
        with self._lock:
            self._kept.clear()
            self._prepared.clear()


def snapshot_entry(name: str, data: Any, buffers: SnapshotBuffers | None = None) -> Any:
    """A checkpoint entry training may no longer change: tensors copied to host memory (into
    ``buffers`` when given), a record (callable) built now; bytes are immutable already."""
    if isinstance(data, TensorFile):
        pool = buffers if buffers is not None else SnapshotBuffers()
        # the same kind of file (a ShardFile stays one: its tensors' names go to the index)
        return type(data)(pool.snapshot(name, data.tensors), data.metadata)
    if callable(data):
        return data()
    return data


def resolve_save_async(args: Any, *, operator: bool, world_size: int, fsdp: bool) -> bool:
    """Whether periodic saves are written in the background.

    ``save_async=None`` (the default) turns it on under the operator's environment for a plain
    single process, where nothing observes a checkpoint at ``on_save`` time but our own code:
    not with FSDP, save_on_each_node, save_strategy='best', load_best_model_at_end or
    push_to_hub. As a plain library the default keeps transformers' timing (``on_save`` right
    after the checkpoint's step). ``save_async=True`` works with DDP and FSDP (each rank
    snapshots and writes its own share or shards) and is refused with save_on_each_node (its
    writer gathers every rank's files at the commit).
    """
    value = getattr(args, "save_async", None)
    each_node = bool(getattr(args, "save_on_each_node", False)) and world_size > 1
    if value is None:
        return (
            operator
            and world_size == 1
            and not fsdp
            and not each_node
            and getattr(args, "save_strategy", None) != "best"
            and not getattr(args, "load_best_model_at_end", False)
            and not getattr(args, "push_to_hub", False)
        )
    if value and each_node:
        raise ConfigurationError(
            "save_async=True is not supported with save_on_each_node=True (its checkpoint "
            "writer is collective and cannot run beside training); set save_async=False or "
            "leave it None"
        )
    return bool(value)


def _drop_frame_locals(exc: BaseException) -> None:
    """Keep the tracebacks of ``exc`` and its causes for the report, not the locals of their
    frames: those hold the snapshot's tensors, whose memory must go with the write."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


class BackgroundSave:
    """One rank's files of one checkpoint, written by a daemon thread.

    ``entries``: (name, data, per_rank) with data bytes or a snapshotted TensorFile. The thread
    never commits (that is collective: the training thread calls ``writer.commit()``).
    ``begin``: the thread calls ``writer.begin()`` first (one rank only: no barrier).
    """

    def __init__(
        self, writer: Any, entries: list[tuple[str, Any, bool]], *, begin: bool = False
    ) -> None:
        self.writer = writer
        self.step: int = writer.step
        self.error: BaseException | None = None
        self.cancelled = False
        self._started = time.monotonic()
        self._finished: float | None = None
        self._cancel = threading.Event()
        writer.cancel = self._cancel
        self._begin = begin
        self._thread = threading.Thread(
            target=self._run,
            args=(entries,),
            name=f"checkpoint-writer-{self.step}",
            # a process that exits (or is killed) mid-write leaves an incomplete checkpoint
            daemon=True,
        )
        self._thread.start()

    def _run(self, entries: list[tuple[str, Any, bool]]) -> None:
        try:
            if self._begin:
                # one rank: the sentinel (fsynced) needs no barrier, so it is created here,
                # still before any file of the checkpoint
                self.writer.begin()
            self.writer.write_entries(entries)
        except Cancelled:
            self.cancelled = True
        except BaseException as exc:  # reported to the training thread at the commit
            logger.error("background write of %s failed: %s", self.writer.path, exc)
            _drop_frame_locals(exc)
            self.error = exc
        finally:
            # the snapshot's host memory goes as soon as this rank's files are written (unless
            # SnapshotBuffers keeps it for the next save)
            entries.clear()
            self._finished = time.monotonic()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def cancel(self) -> None:
        """Stop the writer between blocks and wait for the thread to end."""
        self._cancel.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        """From the snapshot to the last file written (the write a JIT save would repeat)."""
        end = self._finished if self._finished is not None else time.monotonic()
        return end - self._started
