"""Operator-side view of the checkpoint storage.

The pods see the checkpoint root as ``spec.checkpoint.uri``; the operator may see the same data
under another URL (a mounted volume at another path, an object store with its own credentials).
A :class:`PathMap` translates pod URIs to operator URLs; without a matching entry the operator does
not read storage and relies on what the runtime reports. It only uses storage options it was
configured with, never the user's Secrets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trainer_runtime.checkpoint.layout import CheckpointInfo, CheckpointStore
from trainer_runtime.errors import TrainerRuntimeError

__all__ = [
    "MAX_READS_IN_FLIGHT",
    "NEWEST_INSPECTED",
    "READ_TIMEOUT_SECONDS",
    "REUSE_SECONDS",
    "CheckpointView",
    "PathMap",
    "StorageReads",
    "StorageSnapshot",
    "parse_path_map",
]

log = logging.getLogger(__name__)

READ_TIMEOUT_SECONDS = 15.0
"""Deadline of one look at a TrainingJob's checkpoint root (a listing plus a few manifests). A
hung NFS mount or object store then costs a pass this long, and the next attempt gets
``latest`` (the runtime resolves it), instead of holding a worker thread for good. S3 requests
have their own bounded timeouts and retries as well (``object_store.s3_options``)."""

NEWEST_INSPECTED = 8
"""Checkpoint directories looked into per look, newest first, stopping at the first complete
one: the cost stays the same however many checkpoints ``save_total_limit`` keeps."""

REUSE_SECONDS = 60.0
"""A look taken when an attempt is recorded serves the pass that creates the next attempt
(they follow each other at once): storage is read once per requeue, not twice."""

MAX_READS_IN_FLIGHT = 8
"""Looks past their deadline that may still hang at once (operator-wide); with that many, no
further look starts (each counts as "not visible") until one of them returns."""

_T = TypeVar("_T")


@dataclass(frozen=True)
class PathMap:
    """Ordered (pod prefix, operator prefix) pairs; the longest matching prefix wins."""

    entries: tuple[tuple[str, str], ...] = ()
    storage_options: dict[str, Any] = field(default_factory=dict)

    def to_operator(self, pod_uri: str) -> str | None:
        """The operator URL for ``pod_uri``, or None when storage is not readable from here."""
        best: tuple[str, str] | None = None
        for pod_prefix, op_prefix in self.entries:
            p = pod_prefix.rstrip("/")
            if (pod_uri == p or pod_uri.startswith(p + "/")) and (
                best is None or len(p) > len(best[0])
            ):
                best = (p, op_prefix.rstrip("/"))
        if best is None:
            return None
        return best[1] + pod_uri[len(best[0]) :]


def parse_path_map(items: Iterable[str]) -> PathMap:
    """Parse ``POD_PREFIX=OPERATOR_PREFIX`` strings (``/ckpt=/mnt/ckpt``, ``s3://b=s3://b``)."""
    entries = []
    for item in items:
        pod, sep, op = item.partition("=")
        if not sep or not pod or not op:
            raise ValueError(
                f"--checkpoint-path-map {item!r}: expected POD_PREFIX=OPERATOR_PREFIX, "
                "e.g. /checkpoints=/mnt/checkpoints"
            )
        entries.append((pod, op))
    return PathMap(tuple(entries))


@dataclass(frozen=True)
class StorageSnapshot:
    """What the operator saw in storage, with paths translated back to the pods' view.

    Only the newest checkpoints are looked at (:data:`NEWEST_INSPECTED`, newest first, down to
    the newest complete one): ``incomplete`` lists those newer than ``latest_complete`` (the
    ones a resume skips); ``latest_complete`` is None when none of them is complete, which
    does not prove that the root holds no complete checkpoint."""

    latest_complete: CheckpointInfo | None
    latest_complete_path: str | None
    incomplete: tuple[tuple[CheckpointInfo, str], ...]


class StorageNotVisible(Exception):
    """The operator cannot tell what the checkpoint root holds (why: the message)."""


_in_flight_lock = threading.Lock()
# operator URL -> the thread still reading it (removed when the read returns, in time or not)
_in_flight: dict[str, threading.Thread] = {}
# the URLs of _in_flight whose pass stopped waiting: reads past their deadline
_overdue: set[str] = set()


def _with_deadline(key: str, call: Callable[[], _T], timeout: float) -> _T:
    """``call()`` in a daemon thread, waiting at most ``timeout`` seconds for it.

    A call that does not return in time is left to finish on its own (a thread blocked in a
    hung NFS read cannot be interrupted); while it runs, no other read of ``key`` starts, and
    with :data:`MAX_READS_IN_FLIGHT` such overdue reads no read starts at all (reads within
    their deadline do not count: a burst of requeues is not refused). Raises StorageNotVisible
    on time-out or when no read may start; re-raises what ``call`` raised."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the waiting pass, never lost in the thread
            box["error"] = exc
        finally:
            # Out of _in_flight before the waiter wakes: a look right after this one must not
            # find this thread still alive (in this block) and be refused as overlapping.
            with _in_flight_lock:
                if _in_flight.get(key) is threading.current_thread():
                    del _in_flight[key]
                    _overdue.discard(key)
            done.set()

    with _in_flight_lock:
        earlier = _in_flight.get(key)
        if earlier is not None and earlier.is_alive():
            raise StorageNotVisible(f"an earlier read of {key} has not returned yet")
        if len(_overdue) >= MAX_READS_IN_FLIGHT:
            raise StorageNotVisible(
                f"{len(_overdue)} storage reads past their deadline have not returned yet; "
                "not starting another"
            )
        thread = threading.Thread(target=run, name="checkpoint-read", daemon=True)
        _in_flight[key] = thread
        thread.start()
    if not done.wait(timeout):
        with _in_flight_lock:
            if _in_flight.get(key) is thread:
                _overdue.add(key)
        raise StorageNotVisible(f"no answer from {key} within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class CheckpointView:
    """Reads one TrainingJob's checkpoint root through the path map."""

    def __init__(self, pod_uri: str, path_map: PathMap) -> None:
        self.pod_uri = pod_uri.rstrip("/")
        self.operator_url = path_map.to_operator(self.pod_uri)
        self._options = dict(path_map.storage_options)

    @property
    def readable(self) -> bool:
        return self.operator_url is not None

    def pod_path(self, info: CheckpointInfo) -> str:
        return f"{self.pod_uri}/{info.name}"

    def snapshot(
        self, timeout: float | None = READ_TIMEOUT_SECONDS, limit: int = NEWEST_INSPECTED
    ) -> StorageSnapshot | None:
        """The newest checkpoints under the root (completeness rule applied), or None when the
        operator cannot see the root: not mapped, missing (the map may point at another volume
        than the pods': a missing directory is not an empty one), unreadable, an error, or no
        answer within ``timeout`` seconds (None: no deadline, in the calling thread).

        None and "seen, no complete checkpoint" lead to the same resume (``latest``, the runtime
        looks itself); they differ in what the status shows."""
        url = self.operator_url
        if url is None:
            return None
        try:
            if timeout is None:
                return self._read(url, limit)
            return _with_deadline(url, lambda: self._read(url, limit), timeout)
        except Exception as exc:
            # Whatever went wrong, the operator does not know what the root holds: "latest"
            # lets the runtime decide, a failing pass would only be retried.
            expected = isinstance(exc, StorageNotVisible | TrainerRuntimeError | OSError)
            log.warning(
                "checkpoint root %s (%s) not visible to the operator: %s; "
                "the next attempt resolves its checkpoint itself",
                self.pod_uri,
                url,
                exc,
                exc_info=not expected,
            )
            return None

    def _read(self, url: str, limit: int) -> StorageSnapshot:
        store = CheckpointStore(url, self._options or None)
        newest = store.newest(limit, missing_ok=False)
        latest = newest[-1] if newest and newest[-1].complete else None
        return StorageSnapshot(
            latest_complete=latest,
            latest_complete_path=self.pod_path(latest) if latest else None,
            incomplete=tuple((i, self.pod_path(i)) for i in reversed(newest) if not i.complete),
        )


class StorageReads:
    """The operator's looks at checkpoint roots: each under a deadline, and one per requeue.

    ``snapshot(view, key)`` with the key of an earlier call (the pass recording attempt N and
    the pass creating attempt N+1 both use ``(uid, N)``) returns that call's result for
    ``reuse_seconds``: the attempt's pods had all stopped before it was recorded, so nothing of
    this job wrote since."""

    def __init__(
        self,
        timeout: float = READ_TIMEOUT_SECONDS,
        limit: int = NEWEST_INSPECTED,
        reuse_seconds: float = REUSE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = timeout
        self.limit = limit
        self.reuse_seconds = reuse_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._recent: dict[tuple[Hashable, str | None], tuple[float, StorageSnapshot | None]] = {}

    def snapshot(self, view: CheckpointView, key: Hashable) -> StorageSnapshot | None:
        """``view.snapshot()``, or the result of the call with ``key`` less than
        ``reuse_seconds`` ago."""
        cache_key = (key, view.operator_url)
        now = self.clock()
        with self._lock:
            self._recent = {
                k: v for k, v in self._recent.items() if now - v[0] < self.reuse_seconds
            }
            if cache_key in self._recent:
                return self._recent[cache_key][1]
        snap = view.snapshot(self.timeout, self.limit)
        with self._lock:
            self._recent[cache_key] = (self.clock(), snap)
        return snap
