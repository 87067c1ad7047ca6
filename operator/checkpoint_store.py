"""Operator-side view of the checkpoint storage.

The pods see the checkpoint root as ``spec.checkpoint.uri``; the operator may see the same data
under another URL (a mounted volume at another path, an object store with its own credentials).
A :class:`PathMap` translates pod URIs to operator URLs; without a matching entry the operator does
not read storage and relies on what the runtime reports. It only uses storage options it was
configured with, never the user's Secrets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trainer_runtime.checkpoint.layout import CheckpointInfo, CheckpointStore
from trainer_runtime.errors import TrainerRuntimeError

__all__ = ["CheckpointView", "PathMap", "StorageSnapshot", "parse_path_map"]


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
    """What the operator saw in storage, with paths translated back to the pods' view."""

    latest_complete: CheckpointInfo | None
    latest_complete_path: str | None
    incomplete: tuple[tuple[CheckpointInfo, str], ...]


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

    def snapshot(self) -> StorageSnapshot | None:
        """List checkpoints and apply the completeness rule; None when unreadable or on error."""
        if self.operator_url is None:
            return None
        try:
            store = CheckpointStore(self.operator_url, self._options or None)
            infos = store.list()
        except (TrainerRuntimeError, OSError):
            return None
        complete = [i for i in infos if i.complete]
        latest = complete[-1] if complete else None
        return StorageSnapshot(
            latest_complete=latest,
            latest_complete_path=self.pod_path(latest) if latest else None,
            incomplete=tuple((i, self.pod_path(i)) for i in infos if not i.complete),
        )
