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
from typing import Any

import torch

from trainer_runtime.checkpoint.safetensors_stream import Cancelled, TensorFile
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


class SnapshotBuffers:
    """Host buffers the state is copied into at each background save, kept between saves.

    The first snapshot allocates (and the kernel zero-fills) its memory; later ones copy into
    the same buffers, which is a plain memory copy. Reused only once the write that used them is
    over (at most one write is in flight). Tensors on an accelerator get pinned buffers, so the
    device-to-host copy runs at full speed.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def copy(self, key: tuple[str, str], t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        out = self._buffers.get(key)
        if out is None or out.shape != t.shape or out.dtype != t.dtype:
            pin = t.device.type != "cpu" and torch.cuda.is_available()
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            self._buffers[key] = out
        out.copy_(t)
        return out

    def clear(self) -> None:
        self._buffers.clear()


def snapshot_entry(name: str, data: Any, buffers: SnapshotBuffers | None = None) -> Any:
    """A checkpoint entry training may no longer change: tensors copied to host memory (into
    ``buffers`` when given), a record (callable) built now; bytes are immutable already."""
    if isinstance(data, TensorFile):
        pool = buffers if buffers is not None else SnapshotBuffers()
        copied = {k: pool.copy((name, k), t) for k, t in data.tensors.items()}
        return TensorFile(copied, data.metadata)
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
            self.error = exc
        finally:
            entries.clear()  # the snapshot's host memory goes as soon as it is written
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
