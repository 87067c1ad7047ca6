"""Noticing that another rank of the attempt is gone, within seconds, instead of hanging.

When one rank dies (a crash, the OOM killer, a lost node), the others wait for it in their next
collective: gloo sometimes raises at once ("Connection closed by peer"), sometimes not; NCCL waits
out the process group's timeout (30 minutes by default). The operator then deletes the attempt's
pods; the survivors, blocked in the stop vote, are SIGKILLed at the grace deadline.

:class:`PeerWatch` is a daemon thread with its own connection to the rendezvous store
(MASTER_ADDR:MASTER_PORT, the TCPStore rank 0 serves). Every ``interval`` each rank bumps its own
heartbeat counter and reads the counter of the next rank in a ring (so the store sees O(world)
requests per interval, not O(world^2)), and checks one shared key where a rank announces a failure:

- a rank whose training raises announces ``rank N failed: <error>`` before it exits;
- a rank whose successor's counter has not moved for ``timeout`` seconds announces it as gone;
- the store itself unreachable for ``timeout`` seconds means rank 0 (which serves it) is gone.

A rank that sees an announcement (or makes one) ends at once from the watch thread: the main
thread may be blocked inside a collective that never returns. It writes its termination message
(naming the failed rank) and exits with ``EXIT_PEER_FAILED``, distinct from ``EXIT_PREEMPTED``.
A rank that ends normally marks itself done first, so a slower successor is not mistaken for lost.

The heartbeat says a process is alive, not that it gets anywhere: a rank stuck in a collective
(waiting for a peer that never joins it, a wedged device) keeps beating. So the training loop
stamps its own progress (:meth:`PeerWatch.stamp`: a counter and what it is doing, from the main
thread at each step, stop decision, checkpoint barrier and commit), and the watch thread publishes
it with the heartbeat. After a SIGTERM, :data:`HANG_JUDGE_SECONDS` before this rank's deadline,
the watch reads every rank's stamp: ranks whose loop is behind the others (:func:`hung_ranks`;
the others went on, into a barrier where they wait for it) and whose stamp has not moved for a
while are hung. The rank that is hung ends with its own ``failed`` message (exit 1), the others
with ``EXIT_PEER_FAILED`` naming it: the pod ends, its message names the rank, before the grace
ends, instead of a SIGKILL and no message at all.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from trainer_runtime.deadline import EXIT_TEARDOWN_SECONDS
from trainer_runtime.protocol import DEFAULT_PEER_TIMEOUT_SECONDS, ENV_PEER_TIMEOUT_SECONDS
from trainer_runtime.signals import float_from_env

__all__ = [
    "HANG_JUDGE_SECONDS",
    "PeerLoss",
    "PeerWatch",
    "Progress",
    "RingView",
    "hang_loss",
    "hung_ranks",
    "peer_failure_in",
    "peer_timeout_from_env",
]

logger = logging.getLogger(__name__)

_PREFIX = "preemptible/peers"
FAILED_KEY = f"{_PREFIX}/failed"
# How an announcement says the rank is hung (alive, its loop stuck), not gone.
HUNG = "hung:"
# Seconds before this rank's deadline at which the watch judges a hang: what follows still fits
# (a watch tick, the message, the exit's teardown, a tick of slack). No linger for the others to
# read the announcement: every signalled rank judges on its own at its deadline.
HANG_JUDGE_SECONDS = EXIT_TEARDOWN_SECONDS + 2.0
# A rank behind the others counts as hung only once its stamp is at least this old (seconds).
HANG_MIN_STALL_SECONDS = 2.0

# What a collective raises when the other side of a connection went away: gloo's TCP transport,
# NCCL's remote-error and abort reports, torch.distributed's own error types.
_PEER_GONE = re.compile(
    r"Connection closed by peer|Connection reset by peer|gloo.*(Broken pipe|Read error|Timed out)|"
    r"ncclRemoteError|NCCL communicator was aborted|remote process exited",
    re.IGNORECASE,
)
_DIST_ERRORS = ("DistNetworkError", "DistBackendError", "DistStoreError")


def peer_failure_in(exc: BaseException) -> str | None:
    """The error text when ``exc`` (or its cause) says another rank is gone, else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = f"{type(cur).__name__}: {cur}"
        if type(cur).__name__ in _DIST_ERRORS or _PEER_GONE.search(text):
            return text.strip()[:500]
        cur = cur.__cause__ or cur.__context__
    return None


def peer_timeout_from_env() -> float:
    """$PREEMPTIBLE_PEER_TIMEOUT_SECONDS (default 10; 0 turns the watch off)."""
    value = float_from_env(ENV_PEER_TIMEOUT_SECONDS, DEFAULT_PEER_TIMEOUT_SECONDS)
    return DEFAULT_PEER_TIMEOUT_SECONDS if value is None else value


@dataclass(frozen=True)
class PeerLoss:
    """Why this rank stops: which rank is gone (None: unknown) and what was seen."""

    rank: int | None
    detail: str

    @property
    def hung(self) -> bool:
        """The rank is alive but its training loop is stuck (not gone)."""
        return self.detail.startswith(HUNG)

    def message(self, own_rank: int) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "another rank"
        if self.hung:
            what = self.detail[len(HUNG) :].strip()
            if self.rank == own_rank:
                return f"rank {own_rank} hung: {what}"
            return (
                f"rank {own_rank} stopped because {who} of the attempt hung: {what} "
                "(see that rank's pod for its stack)"
            )
        return (
            f"rank {own_rank} stopped because {who} of the attempt is gone: {self.detail} "
            "(see that rank's pod for the cause)"
        )


def _parse_announcement(raw: str) -> PeerLoss:
    rank_text, _, detail = raw.partition(" ")
    return PeerLoss(int(rank_text) if rank_text.lstrip("-").isdigit() else None, detail)


@dataclass(frozen=True)
class Progress:
    """A rank's last progress stamp from its training loop: how many stamps, what it was
    doing, and when (wall clock, seconds)."""

    count: int
    phase: str
    at: float

    def encode(self) -> str:
        return f"{self.count} {self.at:.3f} {self.phase}"

    @staticmethod
    def decode(raw: str | bytes | None) -> Progress | None:
        if raw is None:
            return None
        text = raw.decode() if isinstance(raw, bytes) else raw
        count, _, rest = text.partition(" ")
        at, _, phase = rest.partition(" ")
        try:
            return Progress(int(count), phase, float(at))
        except ValueError:
            return None


def hung_ranks(
    stamps: dict[int, Progress | None], now: float, min_stall: float = HANG_MIN_STALL_SECONDS
) -> list[int]:
    """Pure: the ranks whose training loop is behind the others (the fewest progress stamps,
    when not every rank has as many) and whose last stamp is at least ``min_stall`` seconds old.
    The others went on to a later point (a checkpoint barrier) and wait there for them. Every
    rank at the same count (all waiting in one collective, or all slow): none can be named.
    A rank that never stamped counts as behind once any other did."""
    counts = {r: (p.count if p is not None else -1) for r, p in stamps.items()}
    if not counts or min(counts.values()) == max(counts.values()):
        return []
    low = min(counts.values())
    out = []
    for rank, count in sorted(counts.items()):
        stamp = stamps[rank]
        if count == low and (stamp is None or now - stamp.at >= min_stall):
            out.append(rank)
    return out


def hang_loss(stamps: dict[int, Progress | None], now: float) -> PeerLoss | None:
    """Pure: the announcement for the hung ranks (:func:`hung_ranks`), naming the first, what
    its loop last did and what the others are waiting in; None when none can be named."""
    hung = hung_ranks(stamps, now)
    if not hung:
        return None
    first = stamps[hung[0]]
    ahead = {r: p for r, p in stamps.items() if r not in hung and p is not None}
    where = (
        f"its training loop stopped at '{first.phase}' {now - first.at:.1f} s ago"
        if first is not None
        else "its training loop never reported progress"
    )
    waiting = sorted(ahead)
    phases = sorted({p.phase for p in ahead.values()})
    others = (
        f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting[:8]))}"
        f"{'...' if len(waiting) > 8 else ''} went on to '{', '.join(phases[:3])}' and wait for it"
        if waiting
        else ""
    )
    also = f" (also behind: ranks {hung[1:9]})" if len(hung) > 1 else ""
    return PeerLoss(
        hung[0],
        f"{HUNG} {where}{others}{also}; ended before the grace deadline, "
        "stuck in a collective or the device",
    )


@dataclass
class RingView:
    """What one rank knows of its successor in the ring and of the store (pure bookkeeping: the
    clock is passed in, so the decision is table-testable)."""

    timeout: float
    successor: int
    last_value: int = 0
    last_change: float | None = None
    store_down_since: float | None = None

    def observe(self, now: float, value: int | None, done: bool) -> PeerLoss | None:
        """One tick: ``value`` is the successor's counter (None: the store did not answer)."""
        if value is None:
            if self.store_down_since is None:
                self.store_down_since = now
            if now - self.store_down_since >= self.timeout:
                return PeerLoss(
                    0, f"the rendezvous store (rank 0) unreachable for {self.timeout:g} s"
                )
            return None
        self.store_down_since = None
        if done:
            return None
        if value > self.last_value:
            self.last_value, self.last_change = value, now
            return None
        if self.last_change is None:
            return None  # judged only once the successor has beaten at least once
        if now - self.last_change >= self.timeout:
            return PeerLoss(self.successor, f"no heartbeat for {self.timeout:g} s")
        return None


class PeerWatch:
    """The watch thread of one rank (see the module docstring). ``on_loss`` runs once, in the
    watch thread, when another rank is gone; by default the caller passes a function that writes
    the termination message and ends the process."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        on_loss: Callable[[PeerLoss], None],
        *,
        timeout: float | None = None,
        interval: float = 1.0,
        host: str | None = None,
        port: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        seconds_left: Callable[[], float | None] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = peer_timeout_from_env() if timeout is None else timeout
        self.interval = interval
        self.host = host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.port = int(port or os.environ.get("MASTER_PORT", "29500"))
        self.clock = clock
        self._on_loss = on_loss
        self._store: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loss_lock = threading.Lock()
        self.loss: PeerLoss | None = None
        # Seconds until this rank's deadline after a SIGTERM (None: none yet): when to judge.
        self._seconds_left = seconds_left
        # The training loop's progress stamp (written by the main thread only).
        self._progress = Progress(0, "start", time.time())

    # -- lifecycle
    @property
    def enabled(self) -> bool:
        return self.world_size > 1 and self.timeout > 0

    def start(self) -> PeerWatch:
        if not self.enabled or self._thread is not None:
            return self
        import torch.distributed as dist

        try:
            self._store = dist.TCPStore(
                self.host,
                self.port,
                is_master=False,
                timeout=timedelta(seconds=max(1.0, self.timeout / 2)),
                wait_for_workers=False,
            )
        except Exception as exc:  # the watch is a safety net: never fail training for it
            logger.warning("peer watch off: cannot reach the rendezvous store: %s", exc)
            return self
        self._thread = threading.Thread(
            target=self._run, name="preemptible-peer-watch", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop watching; ``done``: tell the predecessor this rank ended on purpose."""
        self._stop.set()
        if done and self._store is not None:
            self._try(lambda s: s.set(self._done_key(self.rank), "1"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1)
        self._thread = None

    def stamp(self, phase: str) -> None:
        """From the training loop (main thread), never from a thread: it went one point further,
        now doing ``phase``. Cheap (no I/O): the watch thread publishes it."""
        self._progress = Progress(self._progress.count + 1, phase, time.time())

    def announce(self, loss: PeerLoss) -> None:
        """Tell the others (best effort; the first announcement stays) so they stop within one
        interval. Rank 0 serves the store: it lingers two intervals so they can read it (not
        for a hang, judged near the deadline, where every signalled rank judges on its own)."""
        if self._store is None:
            return
        rank = "?" if loss.rank is None else str(loss.rank)
        self._try(lambda s: s.compare_set(FAILED_KEY, "", f"{rank} {loss.detail[:300]}"))
        if self.rank == 0 and not loss.hung:
            time.sleep(2 * self.interval)

    def announce_failure(self, detail: str) -> None:
        """This rank failed (announced as such); its own watch stops."""
        self._stop.set()
        self.announce(PeerLoss(self.rank, detail))

    def claim(self, loss: PeerLoss) -> bool:
        """Record ``loss`` as why this rank stops; False when one was recorded already (the main
        thread and the watch thread may both see the failure)."""
        with self._loss_lock:
            if self.loss is not None:
                return False
            self.loss = loss
            return True

    def announced(self) -> PeerLoss | None:
        """The failure another rank announced, if any (one store round trip)."""
        if self._store is None:
            return None
        raw = self._try(lambda s: s.get(FAILED_KEY).decode() if s.check([FAILED_KEY]) else None)
        loss = _parse_announcement(raw) if raw else None
        # This rank's own failure, announced by itself, is no reason to stop it as a peer's;
        # but a rank that others found hung ends too (its loop may never get anywhere).
        if loss is None or (loss.rank == self.rank and not loss.hung):
            return None
        return loss

    # -- the thread
    def _done_key(self, rank: int) -> str:
        return f"{_PREFIX}/done/{rank}"

    def _try(self, op: Callable[[Any], Any]) -> Any:
        try:
            return op(self._store)
        except Exception:
            return None

    def _progress_key(self, rank: int) -> str:
        return f"{_PREFIX}/progress/{rank}"

    def _due_to_judge(self) -> bool:
        if self._seconds_left is None:
            return False
        try:
            left = self._seconds_left()
        except Exception:
            return False
        return left is not None and left <= HANG_JUDGE_SECONDS

    def _judge_hang(self) -> PeerLoss | None:
        """Every rank's progress stamp now (one round trip): the hung ranks, if any."""
        keys = [self._progress_key(r) for r in range(self.world_size)]

        def read(store: Any) -> list[Any]:
            present = [store.check([k]) for k in keys]
            return [store.get(k) if ok else None for k, ok in zip(keys, present, strict=True)]

        raw = self._try(read)
        if raw is None:
            return None
        stamps = {r: Progress.decode(v) for r, v in enumerate(raw)}
        stamps[self.rank] = self._progress  # this rank's own, fresher than the store's
        return hang_loss(stamps, time.time())

    def _run(self) -> None:
        successor = (self.rank + 1) % self.world_size
        view = RingView(self.timeout, successor)
        hb_own, hb_next = f"{_PREFIX}/hb/{self.rank}", f"{_PREFIX}/hb/{successor}"
        published: Progress | None = None
        judged = False
        while not self._stop.wait(self.interval):
            self._try(lambda s: s.add(hb_own, 1))
            progress = self._progress
            if progress is not published:
                self._try(lambda s, p=progress: s.set(self._progress_key(self.rank), p.encode()))
                published = progress
            loss = self.announced()
            if loss is None and not judged and self._due_to_judge():
                judged = True  # once: near the deadline, what is stuck stays stuck
                loss = self._judge_hang()
            if loss is None:
                value = self._try(lambda s: s.add(hb_next, 0))
                done = bool(self._try(lambda s: s.check([self._done_key(successor)])))
                loss = view.observe(self.clock(), value, done)
            if loss is not None and not self._stop.is_set() and self.claim(loss):
                logger.error("%s", loss.message(self.rank))
                self.announce(loss)  # the others stop within one interval
                self._on_loss(loss)
                return
