"""Fault injection and process helpers for testing preemption with real processes and signals.

Two kinds of helpers live here, importable by any test suite (and by the toy script):

* fsspec filesystems that behave like the local disk but misbehave on purpose, each under its own
  protocol so a training process can be pointed at them with nothing but an output-dir URL:

  - ``slowfile://<path>``: every file written sleeps ``save_sleep`` seconds before it is closed,
    so a signal can be aimed *into* a checkpoint save;
  - ``fulldiskfile://<path>``: writes fail with ``ENOSPC`` once ``enospc_after_bytes`` bytes have
    been written by the process, like a volume that fills up during a save.

  Both append ``save_begin`` / ``save_committed`` events to an events file when the checkpoint
  sentinel is created / removed, so tests synchronise on what really happened, not on sleeps.
* :class:`ToyRun`: starts ``python -m trainer_runtime.toy`` as a real subprocess with the operator's
  environment contract, waits for events, sends signals and reads the termination message.

Importing this module does not import torch (the weight comparison helpers import it lazily).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem, register_implementation
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_GRACE_SECONDS,
    ENV_KILL_WAIT_SECONDS,
    ENV_METRICS_PORT,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    ENV_TERMINATION_LOG,
    TerminationMessage,
    read_termination_message,
)

__all__ = [
    "FaultConfig",
    "FullDiskLocalFileSystem",
    "SlowLocalFileSystem",
    "ToyRun",
    "ToyRunError",
    "append_event",
    "checkpoint_step",
    "configure_faults",
    "drop_from_page_cache",
    "fault_config",
    "load_model_tensors",
    "read_events",
    "register_test_filesystems",
    "weights_identical",
]

# Must equal trainer_runtime.checkpoint.layout.SENTINEL_NAME; repeated here (and checked by the
# runtime tests) so that this module stays importable without the checkpoint package.
_SENTINEL_NAME = "checkpoint-is-incomplete.txt"
_CHECKPOINT_PREFIX = "checkpoint-"


# --------------------------------------------------------------------------------------------
# events
# --------------------------------------------------------------------------------------------


def append_event(events_file: str | os.PathLike[str] | None, event: str, **fields: Any) -> None:
    """Append one JSON line ``{"event": ..., "time": ..., "pid": ..., **fields}`` to the file.

    One ``os.write`` on an ``O_APPEND`` descriptor per line, so lines from several writers never
    interleave and a reader never sees half a line followed by another event.
    """
    if not events_file:
        return
    record = {"event": event, "time": time.time(), "pid": os.getpid(), **fields}
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(os.fspath(events_file), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_events(events_file: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete event lines written so far (a missing file means no events yet)."""
    try:
        data = Path(events_file).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    events = []
    for line in data.splitlines(keepends=True):
        if line.endswith("\n") and line.strip():
            events.append(json.loads(line))
    return events


def checkpoint_step(path: str) -> int | None:
    """The step of the ``checkpoint-<step>`` directory that ``path`` is in (or is), else None."""
    for part in reversed(path.replace("\\", "/").split("/")):
        if part.startswith(_CHECKPOINT_PREFIX):
            suffix = part[len(_CHECKPOINT_PREFIX) :]
            if suffix.isdigit():
                return int(suffix)
    return None


# --------------------------------------------------------------------------------------------
# fault-injecting filesystems
# --------------------------------------------------------------------------------------------


@dataclass
class FaultConfig:
    """Process-wide settings of the test filesystems (one training process = one configuration).

    save_sleep: seconds each written file sleeps before it is closed (``slowfile://``).
    enospc_after_bytes: total bytes the process may write before ``ENOSPC`` (``fulldiskfile://``).
    events_file: where ``save_begin`` / ``save_committed`` events go (None: nowhere).
    """

    save_sleep: float = 0.0
    enospc_after_bytes: int | None = None
    events_file: str | None = None
    bytes_written: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


_CONFIG = FaultConfig()


def fault_config() -> FaultConfig:
    """The live configuration (tests may read ``bytes_written``)."""
    return _CONFIG


def configure_faults(
    *,
    save_sleep: float = 0.0,
    enospc_after_bytes: int | None = None,
    events_file: str | None = None,
) -> FaultConfig:
    """Reset the process-wide fault settings and the byte counter; returns the new config."""
    if save_sleep < 0:
        raise ValueError(f"save_sleep={save_sleep!r} must be >= 0 seconds")
    if enospc_after_bytes is not None and enospc_after_bytes < 0:
        raise ValueError(f"enospc_after_bytes={enospc_after_bytes!r} must be >= 0 (or None)")
    global _CONFIG
    _CONFIG = FaultConfig(
        save_sleep=save_sleep, enospc_after_bytes=enospc_after_bytes, events_file=events_file
    )
    return _CONFIG


def _note_sentinel(path: str, event: str) -> None:
    if os.path.basename(path) == _SENTINEL_NAME:
        append_event(_CONFIG.events_file, event, step=checkpoint_step(path), path=path)


class _FaultyFileOpener(LocalFileOpener):
    """A local file whose writes can fail (disk full) and whose close can be slow."""

    def __init__(self, path: str, mode: str, *, delay: float, budget: bool, **kwargs: Any):
        self._delay = delay
        self._budget = budget
        self._slept = False
        super().__init__(path, mode, **kwargs)

    def write(self, data: Any, *args: Any, **kwargs: Any) -> int:
        if self._budget and _CONFIG.enospc_after_bytes is not None:
            size = len(data) if isinstance(data, str) else memoryview(data).nbytes
            with _CONFIG.lock:
                room = _CONFIG.enospc_after_bytes - _CONFIG.bytes_written
                if size > room:
                    # Write what fits: a real full disk also leaves a truncated file behind.
                    if room > 0:
                        part = data[:room] if isinstance(data, str) else memoryview(data)
                        self.f.write(part if isinstance(part, str) else part.cast("B")[:room])
                        _CONFIG.bytes_written += room
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
                _CONFIG.bytes_written += size
        return self.f.write(data, *args, **kwargs)

    def close(self) -> None:
        # Sleep once, before the file is closed: meanwhile the save is visibly in progress.
        if self._delay > 0 and not self._slept and not self.closed:
            self._slept = True
            time.sleep(self._delay)
        return super().close()


class _InstrumentedLocalFileSystem(AbstractFileSystem):
    """The local disk behind a test protocol, plus save events; subclasses add the fault.

    Deliberately NOT a ``LocalFileSystem`` subclass: the runtime's storage layer writes local
    filesystems with plain ``open()``/``os.replace`` (bypassing fsspec), which would bypass the
    fault too. Behind its own protocol the disk is driven through fsspec like a remote store
    (``fs.open``, ``fs.rm_file``), so every checkpoint byte passes through this class.
    """

    root_marker = "/"
    cachable = False
    _slow = False
    _budget = False

    def __init__(self, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self._local = LocalFileSystem()

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        for proto in cls.protocol if isinstance(cls.protocol, tuple) else (cls.protocol,):
            for sep in ("://", ":"):
                if path.startswith(proto + sep):
                    path = path[len(proto) + len(sep) :]
                    break
        return LocalFileSystem._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        proto = self.protocol[0] if isinstance(self.protocol, tuple) else self.protocol
        return f"{proto}://{self._strip_protocol(name)}"

    # -- reads and metadata: the local disk as is ------------------------------------------
    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._local.ls(self._strip_protocol(path), detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._local.info(self._strip_protocol(path))

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._local.exists(self._strip_protocol(path))

    def isdir(self, path: str) -> bool:
        return self._local.isdir(self._strip_protocol(path))

    def isfile(self, path: str) -> bool:
        return self._local.isfile(self._strip_protocol(path))

    def find(self, path: str, *args: Any, **kwargs: Any) -> Any:
        return self._local.find(self._strip_protocol(path), *args, **kwargs)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        return self._local.cat_file(self._strip_protocol(path), start=start, end=end)

    def invalidate_cache(self, path: str | None = None) -> None:
        return None  # nothing cached: every call goes to the disk

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._local.mkdir(self._strip_protocol(path), create_parents=create_parents)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._local.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def rmdir(self, path: str) -> None:
        self._local.rmdir(self._strip_protocol(path))

    def mv(self, path1: str, path2: str, **kwargs: Any) -> None:
        self._local.mv(self._strip_protocol(path1), self._strip_protocol(path2))

    # -- writes: where the faults and events are -------------------------------------------
    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "r" in mode and "+" not in mode:
            return self._local._open(path, mode)
        _note_sentinel(path, "save_begin")
        return _FaultyFileOpener(
            path,
            mode,
            fs=self._local,
            delay=_CONFIG.save_sleep if self._slow else 0.0,
            budget=self._budget,
        )

    def touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        path = self._strip_protocol(path)
        _note_sentinel(path, "save_begin")
        self._local.touch(path, truncate=truncate)

    def rm_file(self, path: str) -> None:
        path = self._strip_protocol(path)
        self._local.rm_file(path)
        _note_sentinel(path, "save_committed")

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        paths = [self._strip_protocol(p) for p in (path if isinstance(path, list) else [path])]
        self._local.rm(paths, recursive=recursive, maxdepth=maxdepth)
        for p in paths:
            _note_sentinel(p, "save_committed")


class SlowLocalFileSystem(_InstrumentedLocalFileSystem):
    """``slowfile://``: the local disk, but every written file takes ``save_sleep`` s to close."""

    protocol = ("slowfile",)
    _slow = True


class FullDiskLocalFileSystem(_InstrumentedLocalFileSystem):
    """``fulldiskfile://``: the local disk until ``enospc_after_bytes`` bytes, then ENOSPC."""

    protocol = ("fulldiskfile",)
    _budget = True


def register_test_filesystems() -> None:
    """Make ``slowfile://`` and ``fulldiskfile://`` URLs resolvable by fsspec in this process."""
    register_implementation("slowfile", SlowLocalFileSystem, clobber=True)
    register_implementation("fulldiskfile", FullDiskLocalFileSystem, clobber=True)


# --------------------------------------------------------------------------------------------
# cold reads
# --------------------------------------------------------------------------------------------


def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Make a file, or every file under a directory, cold: written back (fsync) and its clean
    pages dropped (``POSIX_FADV_DONTNEED``), so the next read comes from the disk."""
    root = Path(path)
    for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --------------------------------------------------------------------------------------------
# checkpoint weights
# --------------------------------------------------------------------------------------------


def load_model_tensors(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor of the model a checkpoint holds (imports torch): ``model.safetensors``, the
    shards of ``model.safetensors.index.json`` (a save the ranks shared), or the pieces of a
    sharded (FSDP) checkpoint put together."""
    import json

    from safetensors.torch import load_file

    root = Path(checkpoint_dir)
    path = root / "model.safetensors"
    if path.is_file():
        return load_file(str(path))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        tensors: dict[str, Any] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            tensors.update(load_file(str(root / shard)))
        return tensors
    manifest = root / "manifest.json"
    if manifest.is_file() and "sharding" in json.loads(manifest.read_text()):
        from trainer_runtime.distributed.fsdp import consolidated_model

        return consolidated_model(str(root))
    raise FileNotFoundError(f"{path} does not exist: is {checkpoint_dir} a model checkpoint?")


def weights_identical(
    checkpoint_a: str | os.PathLike[str], checkpoint_b: str | os.PathLike[str]
) -> tuple[bool, str]:
    """Whether both checkpoints hold bit-identical model tensors (torch.equal on each one).

    Returns (identical, explanation) so a failing assertion says which tensor differs.
    """
    import torch

    a = load_model_tensors(checkpoint_a)
    b = load_model_tensors(checkpoint_b)
    if set(a) != set(b):
        return False, f"tensor names differ: {sorted(set(a) ^ set(b))}"
    for name in sorted(a):
        ta, tb = a[name], b[name]
        if ta.dtype != tb.dtype or ta.shape != tb.shape:
            return False, f"{name}: {ta.dtype}{tuple(ta.shape)} != {tb.dtype}{tuple(tb.shape)}"
        if not torch.equal(ta, tb):
            diff = (ta.double() - tb.double()).abs().max().item()
            return False, f"{name}: values differ (max abs difference {diff:.3e})"
    return True, f"{len(a)} tensors bit-identical"


# --------------------------------------------------------------------------------------------
# a real training subprocess
# --------------------------------------------------------------------------------------------


class ToyRunError(AssertionError):
    """A toy subprocess did not do what a test waited for; the message carries its output."""


class ToyRun:
    """One ``python -m trainer_runtime.toy`` process, started the way the operator starts a pod.

    The environment gets PREEMPTIBLE_OUTPUT_DIR, PREEMPTIBLE_ATTEMPT, PREEMPTIBLE_RESUME_FROM,
    PREEMPTIBLE_KILL_WAIT_SECONDS (unless ``kill_wait`` is None: the runtime default applies),
    a private termination-log file and single-threaded torch. stdout and stderr go to ``log_file``.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        workdir: str | os.PathLike[str],
        *,
        args: Sequence[str] = (),
        attempt: int = 1,
        resume_from: str | None = None,
        kill_wait: float | None = 0.2,
        grace_seconds: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        # a local path, or kept as given when it is a URL (s3://...: Path would fold its "//")
        self.output_dir: Path | str = (
            str(output_dir) if "://" in str(output_dir) else Path(output_dir)
        )
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.attempt = attempt
        self.events_file = self.workdir / f"events-a{attempt}.jsonl"
        self.log_file = self.workdir / f"log-a{attempt}.txt"
        self.termination_log = self.workdir / f"termination-a{attempt}.json"
        for stale in (self.events_file, self.log_file, self.termination_log):
            stale.unlink(missing_ok=True)
        self.args = [*args, "--events-file", str(self.events_file)]
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
        child_env.pop(ENV_METRICS_PORT, None)
        child_env.update(
            {
                ENV_OUTPUT_DIR: str(self.output_dir),
                ENV_ATTEMPT: str(attempt),
                ENV_RESUME_FROM: resume_from or "",
                ENV_TERMINATION_LOG: str(self.termination_log),
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if kill_wait is not None:
            child_env[ENV_KILL_WAIT_SECONDS] = str(kill_wait)
        if grace_seconds is not None:
            child_env[ENV_GRACE_SECONDS] = str(grace_seconds)
        child_env.update(env or {})
        self.env = child_env
        self.proc: subprocess.Popen[bytes] | None = None
        self.signals_sent: list[tuple[str, float]] = []
        self.returncode: int | None = None
        self.ended_at: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> ToyRun:
        if isinstance(self.output_dir, Path):
            self.output_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer_runtime.toy", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
            )
        self.started_at = time.monotonic()
        return self

    def send(self, sig: signal.Signals) -> float:
        """Send ``sig`` to the process (real ``os.kill``); returns the monotonic send time."""
        assert self.proc is not None, "start() first"
        now = time.monotonic()
        os.kill(self.proc.pid, sig)
        self.signals_sent.append((sig.name, now))
        return now

    def wait(self, timeout: float = 120.0) -> int:
        """Wait for exit; returns the exit status (negative: killed by that signal)."""
        assert self.proc is not None, "start() first"
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise ToyRunError(
                f"toy run (attempt {self.attempt}) still running after {timeout}s; killed it.\n"
                + self.tail()
            ) from None
        self.ended_at = time.monotonic()
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the process if it is still running (test cleanup)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ToyRun:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    # -- observation -------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.events_file)

    def wait_for_event(
        self,
        event: str,
        *,
        step: int | None = None,
        where: Callable[[dict[str, Any]], bool] | None = None,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        """Block until an event named ``event`` (at ``step``, matching ``where``) is written.

        Fails fast, with the process output, when the process exits first.
        """
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while True:
            for record in self.events():
                if record.get("event") != event:
                    continue
                if step is not None and record.get("step") != step:
                    continue
                if where is not None and not where(record):
                    continue
                return record
            if self.proc.poll() is not None:
                # One more look: the event may have been written right before the exit.
                if any(r.get("event") == event for r in self.events()):
                    continue
                raise ToyRunError(
                    f"toy run (attempt {self.attempt}) exited with {self.proc.returncode} before "
                    f"event {event!r} (step={step}).\n" + self.tail()
                )
            if time.monotonic() > deadline:
                raise ToyRunError(
                    f"no event {event!r} (step={step}) within {timeout}s.\n" + self.tail()
                )
            time.sleep(0.02)

    def output(self) -> str:
        try:
            return self.log_file.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 40) -> str:
        text = self.output().splitlines()[-lines:]
        return f"--- last {len(text)} lines of {self.log_file} ---\n" + "\n".join(text)

    def termination_message(self) -> TerminationMessage:
        """The parsed termination message; fails with the process output when there is none."""
        try:
            raw = self.termination_log.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ToyRunError(f"no termination message written.\n{self.tail()}") from None
        msg = read_termination_message(raw)
        if msg is None:
            raise ToyRunError(f"termination message is not valid: {raw!r}\n{self.tail()}")
        return msg

    def steps_begun(self) -> Iterator[int]:
        """The steps whose step_begin event was written, in order."""
        for record in self.events():
            if record.get("event") == "step_begin":
                yield int(record["step"])
