"""Pinned staging of background saves: keep it, pin it ahead of the save, or pin at the save.

Pinning is most of a ``save_async`` stall on a GPU: measured on an H200, a 3.94 GiB snapshot
stalled training 1.76-1.89 s when its memory was mapped and pinned at the save (about 0.45 s per
GiB) against 0.078 s when kept pinned from the save before. So, per rank:

* ``keep``: the snapshot's pinned memory is kept for the whole run and reused by every save
  (the stall is the copy's: about 0.02 s per GiB);
* ``pin_ahead``: given back once the write is done, and pinned again on a side thread during
  the steps before the next periodic save falls due (:func:`pin_ahead_due`), so the save finds
  it ready; memory is held from a few steps before a save to the end of its write;
* ``at_save``: pinned at the save and given back after the write (the stall includes pinning).

:func:`staging_mode` decides from the host memory left (``/proc/meminfo`` MemAvailable, and the
cgroup's ``memory.max`` less ``memory.current`` when a limit is set), shared by the node's local
ranks: keep when the state's bytes are at most :data:`KEEP_SHARE` of a rank's part, pin ahead
when at most :data:`PIN_AHEAD_SHARE`, else at the save. ``TrainingArguments.
save_async_keep_snapshot`` forces ``keep`` (True) or ``pin_ahead`` (False); None decides. A
state with no CUDA tensor pins nothing (``at_save``: its snapshot memory is given back after the
write, as before).

A stall over :data:`STALL_LIMIT` x the write it spared training (the background write's seconds,
about what a blocking save takes) is logged as a warning with both figures. At a JIT stop the
kept memory is given back when memory is short (the decision, made again with the kept bytes
counted as free, is no longer ``keep``): the JIT save writes through its own ring.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from trainer_runtime.checkpoint.background import SnapshotBuffers

__all__ = [
    "AT_SAVE",
    "KEEP",
    "KEEP_SHARE",
    "MODES",
    "PIN_AHEAD",
    "PIN_AHEAD_SHARE",
    "PIN_SECONDS_PER_GIB",
    "STALL_LIMIT",
    "HostMemory",
    "PinnedStaging",
    "local_ranks_from_env",
    "pin_ahead_due",
    "read_host_memory",
    "staging_mode",
    "stall_too_long",
]

logger = logging.getLogger(__name__)

KEEP = "keep"
PIN_AHEAD = "pin_ahead"
AT_SAVE = "at_save"
MODES = (KEEP, PIN_AHEAD, AT_SAVE)

# Keep at most half of a rank's part of the free host memory pinned for the whole run: the rest
# is for data loading, the page cache of the writes, the JIT save's ring and other processes.
KEEP_SHARE = 0.5
# Pinning ahead holds the memory only a few steps longer than the save itself needs it.
PIN_AHEAD_SHARE = 0.8
# The stall a background save may cost, as a fraction of the blocking save it replaces.
STALL_LIMIT = 0.1
# Mapping and pinning, measured on an H200 (torch pin_memory 0.41 s/GiB, cudaHostRegister
# 0.44 s/GiB): the first estimate of how far ahead to pin, before one was measured here.
PIN_SECONDS_PER_GIB = 0.45

_GIB = 1 << 30


@dataclass(frozen=True)
class HostMemory:
    """Host memory left: MemAvailable, and the cgroup's limit and usage (None: no limit)."""

    available: int
    cgroup_limit: int | None = None
    cgroup_used: int | None = None

    @property
    def usable(self) -> int:
        if self.cgroup_limit is None:
            return max(0, self.available)
        return max(0, min(self.available, self.cgroup_limit - (self.cgroup_used or 0)))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def read_host_memory(
    meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup"
) -> HostMemory:
    """This machine's :class:`HostMemory` (cgroup v2; no limit when its files are absent)."""
    available = 0
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # kB
                break
    except (OSError, ValueError, IndexError):
        pass
    root = Path(cgroup)
    limit = _read_int(root / "memory.max")
    used = _read_int(root / "memory.current") if limit is not None else None
    return HostMemory(available, limit, used)


def local_ranks_from_env(environ: Mapping[str, str] | None = None) -> int:
    """Processes of this job on the node (torchrun's ``LOCAL_WORLD_SIZE``; 1 when unset)."""
    env = os.environ if environ is None else environ
    try:
        return max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def staging_mode(memory: HostMemory, local_ranks: int, state_bytes: int, *, held: int = 0) -> str:
    """``keep``, ``pin_ahead`` or ``at_save`` for a rank whose snapshot pins ``state_bytes``,
    one of ``local_ranks`` on the node, holding ``held`` bytes of it already (counted as
    free). Nothing to pin: ``at_save``."""
    if state_bytes <= 0:
        return AT_SAVE
    per_rank = memory.usable // max(1, local_ranks) + max(0, held)
    if state_bytes <= KEEP_SHARE * per_rank:
        return KEEP
    if state_bytes <= PIN_AHEAD_SHARE * per_rank:
        return PIN_AHEAD
    return AT_SAVE


def pin_ahead_due(
    step: int, save_steps: int, step_seconds: float | None, pin_seconds: float
) -> bool:
    """Whether to pin now for the periodic save at the next multiple of ``save_steps``: once
    the steps left take about as long as pinning (one step to spare). Not on the save's own
    step (the snapshot pins what it needs)."""
    if save_steps <= 0:
        return False
    left = save_steps - step % save_steps
    if left == save_steps:
        return False  # a save is due at this very step
    per_step = step_seconds if step_seconds and step_seconds > 0 else None
    lead = 1 if per_step is None else math.ceil(pin_seconds / per_step) + 1
    return left <= lead


def stall_too_long(stall_seconds: float, write_seconds: float) -> bool:
    """A background save's stall over :data:`STALL_LIMIT` x the write it spared training."""
    return write_seconds > 0 and stall_seconds > STALL_LIMIT * write_seconds


class PinnedStaging:
    """One rank's pinned staging policy around its :class:`SnapshotBuffers`.

    ``setting``: ``save_async_keep_snapshot`` (True: keep, False: pin ahead, None: decided by
    :func:`staging_mode` at the first snapshot, from ``memory()``)."""

    def __init__(
        self,
        setting: bool | None,
        *,
        local_ranks: int = 1,
        read_memory: Callable[[], HostMemory] = read_host_memory,
    ) -> None:
        self.setting = setting
        self.local_ranks = max(1, local_ranks)
        self._read_memory = read_memory
        # kept until the first snapshot decided otherwise, so that a kept mode reuses it
        self.buffers = SnapshotBuffers(keep=setting is not False)
        self.mode: str | None = None
        self.state_bytes = 0
        self.last_stall: float | None = None
        self.warnings = 0
        self.snapshots = 0
        self._ahead: threading.Thread | None = None
        self._pin_seconds: float | None = None

    # -- around a snapshot ---------------------------------------------------------------------
    def before_snapshot(self) -> None:
        """A pin-ahead still running: wait for it (the snapshot then uses what it pinned)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.join()
        self.buffers.allocate_seconds = 0.0

    def after_snapshot(self, stall_seconds: float) -> None:
        """Record the stall; at the first snapshot decide the mode (now that the state's CUDA
        bytes are known) and log it."""
        self.last_stall = stall_seconds
        self.snapshots += 1
        self.state_bytes = self.buffers.pinned_layout_bytes
        if self._pin_seconds is None and self.buffers.allocate_seconds > 0 and self.state_bytes:
            self._pin_seconds = self.buffers.allocate_seconds  # the first save pinned it all
        if self.mode is not None:
            return
        if self.setting is True:
            self.mode = KEEP  # (CPU tensors too: their blocks are kept, unpinned)
        elif self.state_bytes == 0:
            self.mode = AT_SAVE  # nothing to pin: given back after the write
        elif self.setting is False:
            self.mode = PIN_AHEAD
        else:
            memory = self._read_memory()
            self.mode = staging_mode(
                memory, self.local_ranks, self.state_bytes, held=self.buffers.held_bytes
            )
        self.buffers.keep = self.mode == KEEP
        if not self.buffers.keep:
            self.buffers.clear()  # the first snapshot's buffers go with its write
        logger.info(
            "pinned staging: %s (%.2f GiB of CUDA tensors per snapshot on this rank, %d local "
            "ranks; save_async_keep_snapshot=%s)",
            self.mode,
            self.state_bytes / _GIB,
            self.local_ranks,
            self.setting,
        )

    def after_write(self, write_seconds: float) -> bool:
        """Once the background write is done: True when the stall was over the limit, logged
        with both figures: a warning the first time in a run, then at INFO (a stall over the
        limit is usually so at every save). The first snapshot of a run pins its memory in
        every mode (its layout was not known before): logged at INFO, not counted."""
        stall = self.last_stall
        if stall is None or not stall_too_long(stall, write_seconds):
            return False
        message = (
            "save_async stalled training %.3f s, over %.0f%% of the %.3f s its write took "
            "(pinned staging: %s%s)"
        )
        first = self.snapshots <= 1
        level = logging.INFO if first or self.warnings else logging.WARNING
        note = "; the first save of the run pins its memory" if first else ""
        logger.log(level, message, stall, STALL_LIMIT * 100, write_seconds, self.mode, note)
        if first:
            return False
        self.warnings += 1
        return True

    # -- between saves -------------------------------------------------------------------------
    def pin_seconds(self) -> float:
        if self._pin_seconds is not None:
            return self._pin_seconds
        return PIN_SECONDS_PER_GIB * self.state_bytes / _GIB

    def maybe_pin_ahead(
        self, step: int, save_steps: int, step_seconds: float | None, *, writing: bool
    ) -> threading.Thread | None:
        """In the pin-ahead mode, start pinning the next snapshot's memory on a side thread
        when the next periodic save is near (not while a write still holds the last one)."""
        if self.mode != PIN_AHEAD or writing or self._ahead is not None:
            return None
        if not pin_ahead_due(step, save_steps, step_seconds, self.pin_seconds()):
            return None
        thread = threading.Thread(target=self._pin_ahead, name="ckpt-pin-ahead", daemon=True)
        self._ahead = thread
        thread.start()
        return thread

    def _pin_ahead(self) -> None:
        started = time.perf_counter()
        try:
            pinned = self.buffers.prepare()
        except Exception as exc:  # the snapshot pins what it needs then
            logger.warning("pinning ahead of the next save failed: %s", exc)
            return
        if pinned:
            self._pin_seconds = time.perf_counter() - started
            logger.debug(
                "pinned %.2f GiB ahead of the next save in %.3f s",
                pinned / _GIB,
                time.perf_counter() - started,
            )

    def on_stop(self) -> bool:
        """At a JIT stop: give the kept (or pinned-ahead) memory back if memory is short now;
        a pin-ahead in progress is told to stop, not waited for. Returns whether it was given
        back."""
        if self.mode != KEEP:
            self.buffers.stop_preparing()  # no periodic save follows a JIT stop
        held = self.buffers.held_bytes
        if not held:
            return False
        if self.mode == KEEP:
            memory = self._read_memory()
            if staging_mode(memory, self.local_ranks, self.state_bytes, held=held) == KEEP:
                return False
        self.buffers.stop_preparing()
        self.buffers.clear()
        logger.info("pinned staging: %.2f GiB given back for the JIT save", held / _GIB)
        return True

    def clear(self) -> None:
        self.before_snapshot()
        self.buffers.clear()

    def metrics(self) -> dict[str, float]:
        """Gauge values: bytes held, and whether the memory is kept between saves."""
        values = {
            "pinned_staging_bytes": float(self.buffers.held_bytes),
            "pinned_staging_kept": 1.0 if self.mode == KEEP else 0.0,
        }
        if self.last_stall is not None:
            values["snapshot_stall_seconds_last"] = self.last_stall
        return values
