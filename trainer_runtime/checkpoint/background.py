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
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
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


# Each tensor of a snapshot starts on a page of its buffer: aligned for any dtype and for DMA;
# what it costs is under 4 KiB a tensor (about 4 MB for a 7B model's weights and AdamW state).
_ALIGN = 4096


def _pageable_buffer(nbytes: int, account: HeldBytes) -> torch.Tensor:
    """``nbytes`` of ordinary memory from the C allocator, counted in ``account`` while any
    tensor uses it. Not a fresh mapping: memory training freed (gradients, temporaries) is
    reused, which makes the first snapshot of a CPU run cheaper (fresh pages are faulted in)."""
    arr = np.empty(nbytes, dtype=np.uint8)
    account.add(nbytes)
    # torch.from_numpy's storage keeps the array alive: it goes with the last view
    weakref.finalize(arr, account.add, -nbytes)
    return torch.from_numpy(arr)


class SnapshotBuffers:
    """Host memory the state is copied into at each background save.

    Each file's tensors are copied into one buffer of exactly their size
    (never rounded up to a power of two), split into views, one per tensor: for tensors on a
    CUDA device a mapping pinned with ``cudaHostRegister``
    (:func:`~trainer_runtime.checkpoint.staging.host_buffer`), so the copies run on a side stream
    at full speed, then one wait; for CPU tensors ordinary memory from the C allocator. Memory is
    bounded by the entries this rank snapshots.

    ``keep`` (``TrainingArguments.save_async_keep_snapshot``) says what happens to a buffer
    once the write that uses it is over:

    * ``False``: nothing is kept here; a buffer lives as long as the snapshot's tensors, which
      :class:`BackgroundSave` drops once this rank's files are written: the memory goes back to
      the OS before the next save, which maps (and, on a GPU, pins) fresh memory;
    * ``True``: each file's buffer is kept and reused by the next snapshot of the same file
      when the tensors' names, dtypes and shapes are the same (at most one write is in flight,
      so it is free by then): later snapshots are a plain copy into warm memory, for holding a
      copy of the state for the whole run;
    * ``None`` (the default): kept for CPU tensors (ordinary memory, which training would
      otherwise fault in afresh at every save: 4-5 times the stall), given back for tensors on
      a GPU (pinned memory, which the OS can never reclaim).
    """

    def __init__(self, keep: bool | None = None) -> None:
        self.keep = keep
        self._kept: dict[tuple[str, bool], tuple[tuple[Any, ...], torch.Tensor]] = {}
        self._held = HeldBytes()

    def snapshot(self, name: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copies of ``tensors`` (the file ``name``) in host memory, views of one buffer per
        kind of memory (pinned for CUDA tensors, ordinary for the rest)."""
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
        offsets: list[int] = []
        total = 0
        for _key, t in items:
            offsets.append(total)
            total += -(-(t.numel() * t.element_size()) // _ALIGN) * _ALIGN
        layout = tuple((key, t.dtype, tuple(t.shape)) for key, t in items)
        buf = self._buffer(name, pinned, layout, total)
        views: dict[str, torch.Tensor] = {}
        engines: dict[torch.device, CopyEngine] = {}
        for (key, t), offset in zip(items, offsets, strict=True):
            nbytes = t.numel() * t.element_size()
            raw = buf[offset : offset + nbytes]
            view = raw.view(t.dtype).reshape(t.shape)
            engine = engines.get(t.device)
            if engine is None:
                engine = engines[t.device] = copies_for(t.device)
                engine.start(t.device)
            engine.copy(view, t)
            views[key] = view
        waits = [engine.mark(device) for device, engine in engines.items()]
        for wait in waits:
            wait()  # training may change the tensors once this returns
        return views

    def _buffer(self, name: str, pinned: bool, layout: tuple[Any, ...], total: int) -> torch.Tensor:
        kept = self._kept.get((name, pinned))
        if kept is not None and kept[0] == layout:
            return kept[1]
        if pinned:
            buf = host_buffer(total, pin=True, account=self._held)
        else:
            buf = _pageable_buffer(total, self._held)
        if self.keep or (self.keep is None and not pinned):
            self._kept[(name, pinned)] = (layout, buf)
        return buf

    def copy(self, key: tuple[str, str], t: torch.Tensor) -> torch.Tensor:
        """One tensor's snapshot (its own buffer; kept under ``key`` when ``keep``)."""
        return self.snapshot("\0".join(key), {key[1]: t})[key[1]]

    @property
    def held_bytes(self) -> int:
        """Bytes of this object's buffers still alive (kept, or held by a write in flight)."""
        return self._held.value

    def clear(self) -> None:
        """Drop the kept buffers (their memory goes once no write uses them)."""
        self._kept.clear()


def snapshot_entry(name: str, data: Any, buffers: SnapshotBuffers | None = None) -> Any:
    """A checkpoint entry training may no longer change: tensors copied to host memory (into
    ``buffers`` when given), a record (callable) built now; bytes are immutable already."""
    if isinstance(data, TensorFile):
        pool = buffers if buffers is not None else SnapshotBuffers()
        return TensorFile(pool.snapshot(name, data.tensors), data.metadata)
    if callable(data):
        return data()
    return data


def resolve_save_async(args: Any, *, operator: bool, world_size: int, fsdp: bool) -> bool:
    """Whether periodic saves are written in the background.

    ``save_async=None`` (the default) turns it on under the operator's environment for a plain
    single process, where nothing observes a checkpoint at ``on_save`` time but our own code:
    not with FSDP, save_on_each_node, save_strategy='best', load_best_model_at_end or
    push_to_hub. As a plain library the default keeps transformers' timing (``on_save`` right
    after the checkpoint's step). ``save_async=True`` is refused with FSDP (its sharded writer
    is collective) and with save_on_each_node.
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
    if value and (fsdp or each_node):
        what = "fsdp" if fsdp else "save_on_each_node=True"
        raise ConfigurationError(
            f"save_async=True is not supported with {what} (its checkpoint writer is collective "
            "and cannot run beside training); set save_async=False or leave it None"
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
