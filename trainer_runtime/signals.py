"""The SIGTERM latch: the signal handler only records when the first SIGTERM arrived.

All decisions (wait ``kill_wait``, finish the optimizer step in flight, save, exit) are taken by the
training loop at step boundaries, never inside the handler: a handler that saved or raised could
interrupt a collective or a half-written file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from trainer_runtime.deadline import deadline_budget
from trainer_runtime.protocol import (
    DEFAULT_KILL_WAIT_SECONDS,
    ENV_GRACE_SECONDS,
    ENV_KILL_WAIT_SECONDS,
    ENV_NODE_NOTICE_FILE,
    ENV_NODE_NOTICE_SECONDS,
)

__all__ = [
    "ArrivalStamps",
    "SigtermLatch",
    "float_from_env",
    "grace_seconds_from_env",
    "kill_wait_from_env",
    "launcher_timeout_from_env",
    "node_notice_from_env",
    "node_notice_from_file",
    "process_stamps",
]

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


def float_from_env(name: str, default: float | None) -> float | None:
    """A non-negative number of seconds from ``$name``; ``default`` when unset, not a number or
    negative (with a warning)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        logger.warning("ignoring %s=%r: not a number (using %s)", name, raw, default)
        return default
    if value < 0:
        logger.warning("ignoring %s=%r: negative (using %s)", name, raw, default)
        return default
    return value


def kill_wait_from_env() -> float:
    """Seconds to wait after SIGTERM before acting: $PREEMPTIBLE_KILL_WAIT_SECONDS, default 3."""
    value = float_from_env(ENV_KILL_WAIT_SECONDS, DEFAULT_KILL_WAIT_SECONDS)
    assert value is not None
    return value


def grace_seconds_from_env() -> float | None:
    """This pod's grace period ($PREEMPTIBLE_GRACE_SECONDS), the deadline after SIGTERM; or None."""
    return float_from_env(ENV_GRACE_SECONDS, None)


# torchrun's own shutdown timeout: its option's environment form wins over the variable, 30 s
# without either (torch.distributed.run, launcher.api). Its workers see TORCHELASTIC_RUN_ID.
_TORCHRUN_TIMEOUT_ENV = ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
_TORCHRUN_DEFAULT_TIMEOUT = 30.0


def launcher_timeout_from_env() -> float | None:
    """In a torchrun worker: the seconds after SIGTERM at which torchrun SIGKILLs it (its shutdown
    timeout, from the environment it was given, else torchrun's 30 s); None outside torchrun.
    ``--shutdown-timeout`` given only on torchrun's command line is not visible here (our
    launcher and the operator set the environment too)."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return None
    for name in _TORCHRUN_TIMEOUT_ENV:
        value = float_from_env(name, None)
        if value:
            return value
    return _TORCHRUN_DEFAULT_TIMEOUT


def node_notice_from_env() -> float | None:
    """The node's notice before it goes away ($PREEMPTIBLE_NODE_NOTICE_SECONDS), or None."""
    return float_from_env(ENV_NODE_NOTICE_SECONDS, None)


def node_notice_from_file(path: str | None) -> float | None:
    """The notice of the node this pod landed on, from ``path`` ($PREEMPTIBLE_NODE_NOTICE_FILE:
    a downward-API file of the pod's annotation, which the operator writes once the pod is bound
    and kubelet keeps in sync); None when unset, missing, empty or not a positive number."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            raw = handle.read(64).strip()
    except OSError:
        return None
    try:
        value = float(raw) if raw else None
    except ValueError:
        logger.warning("ignoring node notice %r in %s: not a number", raw, path)
        return None
    return value if value is not None and value > 0 else None


# Linux's SO_TIMESTAMP (not exported by Python's socket module): the kernel stamps each
# datagram with the wall-clock time it was sent.
_SO_TIMESTAMP = 29


class ArrivalStamps:
    """When signals really arrived, even if the Python handler ran much later.

    CPython's C-level signal handler writes the signal number to the "wakeup fd" at once, while
    the Python handler only runs when the main thread returns to the interpreter: after a long
    C call (an NCCL collective, a CUDA synchronisation) that can be seconds later, and a
    deadline counted from then would be too generous. The wakeup fd here is one end of a
    datagram socket pair whose other end has ``SO_TIMESTAMP`` on, so the kernel stamps the
    byte when the C handler wrote it; :meth:`take` reads that stamp. Linux only; not used when
    another wakeup fd is installed (an asyncio loop's), which is left in place.

    One pair serves the whole process (:func:`process_stamps`) and stays open until it exits:
    the wakeup fd is process-wide, and one left pointing at a closed descriptor would make the
    C handler write into whatever file reuses that number.
    """

    def __init__(self) -> None:
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._first: dict[int, float] = {}  # signal -> its earliest stamp read, not yet taken

    def _open(self) -> bool:
        if self._reader is not None:
            return True
        try:
            reader, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            reader.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMP, 1)
            reader.setblocking(False)
            writer.setblocking(False)
        except OSError:
            return False
        self._reader, self._writer = reader, writer
        return True

    def install(self) -> bool:
        """Be the process's wakeup fd (main thread only), dropping stale stamps; False when
        that cannot be (not Linux, or another wakeup fd is installed: that one stays)."""
        if not sys.platform.startswith("linux") or not self._open():
            return False
        assert self._writer is not None
        mine = self._writer.fileno()
        try:
            previous = signal.set_wakeup_fd(mine, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            return False
        if previous not in (-1, mine):  # someone else's (asyncio): theirs stays
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(previous)
            return False
        self.poll()
        self._first.clear()  # what arrived before this install is not ours to count
        return True

    def poll(self) -> None:
        """Read every pending byte (non-blocking), keeping each signal's earliest stamp. Called
        at step boundaries too, so that other signals' bytes (a DataLoader's SIGCHLD) never
        fill the socket's buffer, where a later SIGTERM's byte would be dropped."""
        if self._reader is None:
            return
        while True:
            try:
                data, ancillary, _, _ = self._reader.recvmsg(16, socket.CMSG_SPACE(16))
            except OSError:  # BlockingIOError: nothing left
                return
            if not data or data[0] in self._first:
                continue
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMP and len(payload) >= 16:
                    seconds, micros = struct.unpack("qq", payload[:16])
                    self._first[data[0]] = seconds + micros / 1e6

    def take(self, signum: int) -> float | None:
        """The wall-clock time the earliest ``signum`` not yet taken arrived; None when none
        was stamped."""
        self.poll()
        return self._first.pop(signum, None)


_PROCESS_STAMPS = ArrivalStamps()


def process_stamps() -> ArrivalStamps:
    """The process's :class:`ArrivalStamps` (see there: one pair, kept open)."""
    return _PROCESS_STAMPS


class SigtermLatch:
    """Records the monotonic time of the first SIGTERM; later signals never reset it.

    ``clock`` is injectable so the decision logic is testable without sleeping. ``install`` chains
    to the previous handler's bookkeeping only by restoring it on ``uninstall`` (the previous
    handler is not called: the default one would kill the process).
    """

    def __init__(
        self,
        kill_wait: float | None = None,
        grace_seconds: float | None = None,
        clock: Clock = time.monotonic,
        signum: int = signal.SIGTERM,
        node_notice_seconds: float | None = None,
        node_notice_file: str | None = None,
    ) -> None:
        self.kill_wait = kill_wait_from_env() if kill_wait is None else float(kill_wait)
        self.grace_seconds = grace_seconds_from_env() if grace_seconds is None else grace_seconds
        self.node_notice_seconds = (
            node_notice_from_env() if node_notice_seconds is None else node_notice_seconds
        )
        self.node_notice_file = (
            os.environ.get(ENV_NODE_NOTICE_FILE) if node_notice_file is None else node_notice_file
        )
        # a torchrun worker is SIGKILLed at its agent's shutdown timeout, before the grace ends
        self.launcher_timeout_seconds = launcher_timeout_from_env()
        self._notice_file_read = False
        self.clock = clock
        self.signum = signum
        self.received_at: float | None = None
        self.count = 0
        self._previous: Any = None
        self._installed = False
        self._stamps = process_stamps()

    # -- signal plumbing
    def install(self) -> bool:
        """Install the handler; False (and no handler) when not in the main thread."""
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("SIGTERM handler not installed: train() is not in the main thread")
            return False
        self._previous = signal.signal(self.signum, self._handle)
        self._stamps.install()
        self._installed = True
        return True

    def uninstall(self) -> None:
        """Restore the handler that was in place before ``install``."""
        if not self._installed:
            return
        if threading.current_thread() is threading.main_thread():
            signal.signal(
                self.signum, self._previous if self._previous is not None else signal.SIG_DFL
            )
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Keep the handler trivial: record, nothing else (one non-blocking read, no locks).
        self.trigger(arrived_wall=self._stamps.take(signum))

    # -- state
    def trigger(self, arrived_wall: float | None = None) -> None:
        """Record a SIGTERM (what the handler does; tests call it directly). ``arrived_wall``:
        the wall-clock time the signal really arrived (the kernel's stamp), when known; the
        latch then counts from it, not from when the handler ran."""
        self.count += 1
        if self.received_at is None:
            now = self.clock()
            late = max(0.0, time.time() - arrived_wall) if arrived_wall is not None else 0.0
            self.received_at = now - late
            if late > 0.5:
                logger.warning(
                    "SIGTERM arrived %.2f s before its handler could run (the main thread was "
                    "in a long call); the deadline counts from its arrival",
                    late,
                )

    @property
    def triggered(self) -> bool:
        return self.received_at is not None

    def elapsed(self) -> float | None:
        """Seconds since the first SIGTERM, or None."""
        if self.received_at is None:
            return None
        return self.clock() - self.received_at

    def should_act(self) -> bool:
        """True once a SIGTERM arrived and ``kill_wait`` seconds have passed since."""
        if self.received_at is None and self._installed:
            self._stamps.poll()  # keep the wakeup socket drained (see ArrivalStamps.poll)
        elapsed = self.elapsed()
        return elapsed is not None and elapsed >= self.kill_wait

    @property
    def budget_seconds(self) -> float | None:
        """Seconds from SIGTERM to the deadline: the shortest of grace, node notice and, in a
        torchrun worker, its agent's shutdown timeout."""
        self._read_notice_file()
        return deadline_budget(
            self.grace_seconds, self.node_notice_seconds, self.launcher_timeout_seconds
        )

    def _read_notice_file(self) -> None:
        """Once, after the SIGTERM (not in the handler): the notice of the node the pod landed on
        (:func:`node_notice_from_file`) shortens ``node_notice_seconds``. Read then, not at
        start, because the operator writes it only after the pod is bound and kubelet shows it
        in the file a little later."""
        if self._notice_file_read or self.received_at is None or not self.node_notice_file:
            return
        self._notice_file_read = True
        notice = node_notice_from_file(self.node_notice_file)
        if notice is None:
            return
        if self.node_notice_seconds is None or notice < self.node_notice_seconds:
            self.node_notice_seconds = notice
        logger.info(
            "node notice %.0f s (from %s): deadline %s s after SIGTERM",
            notice,
            self.node_notice_file,
            deadline_budget(self.grace_seconds, self.node_notice_seconds),
        )

    def seconds_left(self) -> float | None:
        """Seconds until the deadline (negative when past it); None without a deadline. The
        deadline is SIGTERM + the grace period, or + the node's notice when that is shorter."""
        elapsed = self.elapsed()
        budget = self.budget_seconds
        if elapsed is None or budget is None:
            return None
        return budget - elapsed

    def __enter__(self) -> SigtermLatch:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
