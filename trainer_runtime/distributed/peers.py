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

from trainer_runtime.protocol import DEFAULT_PEER_TIMEOUT_SECONDS, ENV_PEER_TIMEOUT_SECONDS
from trainer_runtime.signals import float_from_env

__all__ = [
    "PeerLoss",
    "PeerWatch",
    "RingView",
    "peer_failure_in",
    "peer_timeout_from_env",
]

logger = logging.getLogger(__name__)

_PREFIX = "preemptible/peers"
FAILED_KEY = f"{_PREFIX}/failed"

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

    def message(self, own_rank: int) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "another rank"
        return (
            f"rank {own_rank} stopped because {who} of the attempt is gone: {self.detail} "
            "(see that rank's pod for the cause)"
        )


def _parse_announcement(raw: str) -> PeerLoss:
    rank_text, _, detail = raw.partition(" ")
    return PeerLoss(int(rank_text) if rank_text.lstrip("-").isdigit() else None, detail)


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

    def announce(self, loss: PeerLoss) -> None:
        """Tell the others (best effort; the first announcement stays) so they stop within one
        interval. Rank 0 serves the store: it lingers two intervals so they can read it."""
        if self._store is None:
            return
        rank = "?" if loss.rank is None else str(loss.rank)
        self._try(lambda s: s.compare_set(FAILED_KEY, "", f"{rank} {loss.detail[:300]}"))
        if self.rank == 0:
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
        # This rank's own failure, announced by itself, is no reason to stop it as a peer's.
        return None if loss is None or loss.rank == self.rank else loss

    # -- the thread
    def _done_key(self, rank: int) -> str:
        return f"{_PREFIX}/done/{rank}"

    def _try(self, op: Callable[[Any], Any]) -> Any:
        try:
            return op(self._store)
        except Exception:
            return None

    def _run(self) -> None:
        successor = (self.rank + 1) % self.world_size
        view = RingView(self.timeout, successor)
        hb_own, hb_next = f"{_PREFIX}/hb/{self.rank}", f"{_PREFIX}/hb/{successor}"
        while not self._stop.wait(self.interval):
            self._try(lambda s: s.add(hb_own, 1))
            loss = self.announced()
            if loss is None:
                value = self._try(lambda s: s.add(hb_next, 0))
                done = bool(self._try(lambda s: s.check([self._done_key(successor)])))
                loss = view.observe(self.clock(), value, done)
            if loss is not None and not self._stop.is_set() and self.claim(loss):
                logger.error("%s", loss.message(self.rank))
                self.announce(loss)  # the others stop within one interval
                self._on_loss(loss)
                return
