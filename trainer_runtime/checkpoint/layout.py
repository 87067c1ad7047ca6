"""Checkpoint layout, the completeness rule, listing and rotation decisions (torch-free).

Layout (DESIGN.md)::

    <output_dir>/checkpoint-<global_step>/
        checkpoint-is-incomplete.txt   sentinel: created first, removed last, by the coordinator
        model.safetensors, optimizer.safetensors, trainer_state.json, ...
        manifest.json                  the commit point: files, sizes, checksums, step, attempt, ...

A checkpoint is complete iff ``manifest.json`` exists, the sentinel does not, and every file the
manifest lists exists with its listed size. A stock Hugging Face checkpoint (no manifest) is
complete iff there is no sentinel and ``trainer_state.json`` exists.

The operator imports this module, so it must never import torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import CheckpointError, ConfigurationError, StorageError
from trainer_runtime.protocol import ENV_ATTEMPT

__all__ = [
    "ATTEMPTS_DIR",
    "CHECKPOINT_PREFIX",
    "MANIFEST_FORMAT",
    "MANIFEST_NAME",
    "PARTIAL_PREFIX",
    "RUNTIME_STATE_NAME",
    "SENTINEL_NAME",
    "TRAINER_STATE_NAME",
    "CheckpointInfo",
    "CheckpointStore",
    "attempt_from_env",
    "checkpoint_name",
    "fence_attempts",
    "fence_check",
    "infos_from_listing",
    "inspect_checkpoint",
    "is_complete",
    "parse_step",
    "register_attempt",
    "registered_attempts",
    "rotation_victims",
]

SENTINEL_NAME = "checkpoint-is-incomplete.txt"
MANIFEST_NAME = "manifest.json"
TRAINER_STATE_NAME = "trainer_state.json"
# This runtime's own record of a checkpoint (timings, attempt, data position). It is a file of its
# own, not a key of trainer_state.json, so that transformers' TrainerState still loads that file.
RUNTIME_STATE_NAME = "preemptible_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
MANIFEST_FORMAT = "preemptible-checkpoint/1"
# per-rank record of the files a rank wrote, merged by the coordinator into the manifest
PARTIAL_PREFIX = ".partial-rank-"
# Object stores: one small object per attempt that wrote here (``attempt-<N>.json``), written
# before its first sentinel, so the attempt fence is one listing of this prefix instead of a look
# into every checkpoint (fence_attempts).
ATTEMPTS_DIR = ".preemptible-attempts"
_ATTEMPT_RE = re.compile(r"^attempt-(\d+)\.json$")

_CHECKPOINT_RE = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")


@dataclass(frozen=True)
class CheckpointInfo:
    """What is known about one ``checkpoint-<step>`` directory."""

    path: str
    name: str
    step: int
    complete: bool
    reason: str | None
    size_bytes: int
    manifest: dict[str, Any] | None
    attempt: int | None

    @property
    def save_seconds(self) -> float | None:
        value = (self.manifest or {}).get("save_seconds")
        return float(value) if isinstance(value, int | float) else None

    @property
    def created_at(self) -> str | None:
        value = (self.manifest or {}).get("created_at")
        return value if isinstance(value, str) else None


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{int(step)}"


def parse_step(name: str) -> int | None:
    """The global step of a directory named ``checkpoint-<step>``; None for any other name."""
    m = _CHECKPOINT_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def attempt_from_env(value: int | None = None) -> int | None:
    """``value`` if given, else $PREEMPTIBLE_ATTEMPT as an int, else None (no operator)."""
    if value is not None:
        return int(value)
    raw = os.environ.get(ENV_ATTEMPT, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"{ENV_ATTEMPT}={raw!r} is not an integer: set it to the attempt number or unset it"
        ) from None


def is_complete(
    files: Mapping[str, int], manifest: Mapping[str, Any] | None
) -> tuple[bool, str | None]:
    """Apply the completeness rule to a checkpoint directory.

    ``files`` maps every file present (path relative to the checkpoint dir) to its size;
    ``manifest`` is the parsed ``manifest.json`` or None when there is none (or it is unreadable).
    Returns ``(complete, reason)``; ``reason`` says why not, None when complete.
    """
    if SENTINEL_NAME in files:
        return False, f"sentinel {SENTINEL_NAME} present (save interrupted or still in progress)"
    if manifest is None:
        if MANIFEST_NAME in files:
            return False, f"{MANIFEST_NAME} is unreadable"
        if TRAINER_STATE_NAME in files:
            return True, None  # stock Hugging Face checkpoint
        return False, f"{MANIFEST_NAME} missing (and no {TRAINER_STATE_NAME})"
    listed = manifest.get("files")
    if not isinstance(listed, list):
        return False, f"{MANIFEST_NAME} malformed: 'files' is not a list"
    problems: list[str] = []
    for entry in listed:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("path"), str):
            return False, f"{MANIFEST_NAME} malformed: file entry {entry!r} has no 'path'"
        path, size = entry["path"], entry.get("size")
        if path not in files:
            problems.append(f"file {path} missing")
        elif not isinstance(size, int) or files[path] != size:
            problems.append(f"file {path} size {files[path]} != {size} (listed in {MANIFEST_NAME})")
    if problems:
        return False, "; ".join(problems)
    return True, None


def _sort_key(info: CheckpointInfo) -> tuple[int, str]:
    return info.step, info.name


def rotation_victims(
    checkpoints: Iterable[CheckpointInfo],
    save_total_limit: int | None,
    protect: Iterable[str] = frozenset(),
) -> list[CheckpointInfo]:
    """Which checkpoints rotation removes (oldest first); pure.

    - ``save_total_limit`` None: keep everything (Hugging Face semantics), nothing is removed.
    - The newest complete checkpoint is never removed, nor any checkpoint named in ``protect``
      (names or paths; e.g. the best checkpoint). Protected complete checkpoints count towards the
      limit, like Hugging Face (limit 5 with an older best keeps the best and the 4 newest).
    - Complete checkpoints beyond the limit are removed, oldest first.
    - Incomplete checkpoints older than the newest complete one are abandoned writes and removed;
      incomplete ones newer than it may still be being written and are kept.
    - With no complete checkpoint at all, nothing is removed.
    """
    if save_total_limit is None:
        return []
    if (
        isinstance(save_total_limit, bool)
        or not isinstance(save_total_limit, int)
        or save_total_limit < 1
    ):
        raise ConfigurationError(
            f"save_total_limit={save_total_limit!r} is invalid: "
            "use an integer >= 1, or None to keep all"
        )
    protected = {p.rstrip("/").rsplit("/", 1)[-1] for p in protect}
    ordered = sorted(checkpoints, key=_sort_key)
    complete = [c for c in ordered if c.complete]
    if not complete:
        return []
    newest = complete[-1]
    keep = {newest.name} | {c.name for c in complete if c.name in protected}
    for c in reversed(complete):
        if len(keep) >= save_total_limit:
            break
        keep.add(c.name)
    victims = [
        c
        for c in ordered
        if c.name not in keep
        and c.name not in protected
        and (c.complete or _sort_key(c) < _sort_key(newest))
    ]
    return victims


def _sentinel_attempt(storage: Storage, rel: str) -> int | None:
    try:
        data = storage.read_json(f"{rel}/{SENTINEL_NAME}" if rel else SENTINEL_NAME)
    except StorageError:
        return None  # an empty or foreign (e.g. Hugging Face) sentinel carries no attempt
    value = data.get("attempt") if isinstance(data, dict) else None
    return value if isinstance(value, int) else None


def inspect_checkpoint(storage: Storage, rel: str = "") -> CheckpointInfo:
    """Inspect the checkpoint directory ``rel`` of ``storage`` and apply the completeness rule."""
    path = storage.join(rel)
    name = path.rstrip("/").rsplit("/", 1)[-1]
    step = parse_step(name)
    if not storage.isdir(rel):
        return CheckpointInfo(
            path,
            name,
            step if step is not None else -1,
            False,
            "directory does not exist",
            0,
            None,
            None,
        )
    files = storage.walk_files(rel)
    manifest: dict[str, Any] | None = None
    if MANIFEST_NAME in files:
        try:
            loaded = storage.read_json(f"{rel}/{MANIFEST_NAME}" if rel else MANIFEST_NAME)
            manifest = loaded if isinstance(loaded, dict) else None
        except StorageError as exc:
            if exc.not_found:  # vanished between listing and reading: treat as missing
                files = {k: v for k, v in files.items() if k != MANIFEST_NAME}
            # otherwise it stays listed with manifest None, which the rule reports as unreadable
    complete, reason = is_complete(files, manifest)
    attempt: int | None = None
    if manifest is not None and isinstance(manifest.get("attempt"), int):
        attempt = manifest["attempt"]
    elif SENTINEL_NAME in files:
        attempt = _sentinel_attempt(storage, rel)
    if step is None and manifest is not None and isinstance(manifest.get("step"), int):
        step = manifest["step"]
    return CheckpointInfo(
        path=path,
        name=name,
        step=step if step is not None else -1,
        complete=complete,
        reason=reason,
        size_bytes=sum(files.values()),
        manifest=manifest,
        attempt=attempt,
    )


def infos_from_listing(url: str, files: Mapping[str, int]) -> list[CheckpointInfo]:
    """Every checkpoint under ``url`` as one recursive listing (path -> size, relative to the
    output dir) shows it, without reading a manifest; pure.

    Complete here means what the commit order leaves: ``manifest.json`` present and the sentinel
    absent (or, with no manifest, a stock Hugging Face checkpoint's ``trainer_state.json``). The
    manifest's sizes are not compared: the writer compared them before writing it. For rotation
    on object stores, where reading every manifest would cost requests per checkpoint."""
    by_dir: dict[str, dict[str, int]] = {}
    for rel, size in files.items():
        head, sep, tail = rel.strip("/").partition("/")
        if sep and tail and parse_step(head) is not None:
            by_dir.setdefault(head, {})[tail] = int(size)
    base = url.rstrip("/")
    out = []
    for name, listed in by_dir.items():
        unread = {"files": []} if MANIFEST_NAME in listed else None
        complete, reason = is_complete(listed, unread)
        out.append(
            CheckpointInfo(
                path=f"{base}/{name}",
                name=name,
                step=parse_step(name) or 0,
                complete=complete,
                reason=reason,
                size_bytes=sum(listed.values()),
                manifest=None,
                attempt=None,
            )
        )
    return sorted(out, key=_sort_key)


def registered_attempts(storage: Storage) -> list[int]:
    """The attempts that registered as writers of this output dir (:func:`register_attempt`),
    from one listing."""
    if not storage.exists(ATTEMPTS_DIR):
        return []
    found = []
    for name in storage.listdir(ATTEMPTS_DIR):
        m = _ATTEMPT_RE.match(name)
        if m:
            found.append(int(m.group(1)))
    return sorted(found)


def register_attempt(storage: Storage, attempt: int | None, host: str = "") -> None:
    """Record that ``attempt`` writes checkpoints here (before its first sentinel), so that
    :func:`fence_attempts` stops every older attempt; idempotent. No-op without an attempt."""
    if attempt is None:
        return
    rel = f"{ATTEMPTS_DIR}/attempt-{attempt}.json"
    if storage.exists(rel):
        return
    storage.write_json(rel, {"attempt": attempt, "host": host})


def fence_attempts(storage: Storage, attempt: int | None, action: str) -> None:
    """The attempt fence from the registered attempts (one listing, any number of checkpoints):
    CheckpointError when a newer attempt registered. Unknown attempt (None): not fenced."""
    if attempt is None:
        return
    newer = [a for a in registered_attempts(storage) if a > attempt]
    if newer:
        raise CheckpointError(
            f"refusing to {action}: attempt {max(newer)} writes checkpoints to {storage.url} "
            f"({ATTEMPTS_DIR}/attempt-{max(newer)}.json), newer than this writer's attempt "
            f"{attempt} ({ENV_ATTEMPT}); this process is a stale attempt and must stop"
        )


class CheckpointStore:
    """The ``checkpoint-<step>`` directories under one output dir (any fsspec URL)."""

    def __init__(self, output_dir: str, storage_options: dict[str, Any] | None = None) -> None:
        self.output_dir = output_dir
        self.storage = Storage(output_dir, storage_options)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.output_dir!r})"

    def names(self) -> list[str]:
        """Checkpoint directory names, ascending by step."""
        if not self.storage.exists(""):
            return []
        found = [n for n in self.storage.subdirs("") if parse_step(n) is not None]
        return sorted(found, key=lambda n: (parse_step(n), n))

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint, complete or not, ascending by step."""
        return [inspect_checkpoint(self.storage, n) for n in self.names()]

    def inspect(self, path_or_name: str) -> CheckpointInfo:
        """Inspect one checkpoint by name (``checkpoint-5``), step, or full path/URL."""
        text = str(path_or_name).rstrip("/")
        if text.isdigit():
            return inspect_checkpoint(self.storage, checkpoint_name(int(text)))
        if "/" not in text:
            return inspect_checkpoint(self.storage, text)
        prefix = self.storage.url.rstrip("/") + "/"
        if text.startswith(prefix):
            return inspect_checkpoint(self.storage, text[len(prefix) :])
        return inspect_checkpoint(Storage(text, self.storage.storage_options), "")

    def latest_complete(self) -> CheckpointInfo | None:
        """The complete checkpoint with the highest step, or None."""
        for name in reversed(self.names()):
            info = inspect_checkpoint(self.storage, name)
            if info.complete:
                return info
        return None

    def list_from_listing(self) -> list[CheckpointInfo]:
        """Every checkpoint from one recursive listing, no manifest read
        (:func:`infos_from_listing`): for rotation on object stores."""
        if not self.storage.exists(""):
            return []
        return infos_from_listing(self.storage.url, self.storage.walk_files(""))

    def incomplete(self) -> list[CheckpointInfo]:
        return [c for c in self.list() if not c.complete]

    def newest_attempt(self, checkpoints: Sequence[CheckpointInfo] | None = None) -> int | None:
        """The highest attempt number recorded by any checkpoint (manifest or sentinel)."""
        attempts = [c.attempt for c in (self.list() if checkpoints is None else checkpoints)]
        known = [a for a in attempts if a is not None]
        return max(known) if known else None


def fence_check(checkpoints: Iterable[CheckpointInfo], attempt: int | None, action: str) -> None:
    """Raise CheckpointError when any checkpoint was written by an attempt newer than ``attempt``.

    A writer whose attempt is unknown (None, e.g. run outside the operator) is not fenced.
    """
    if attempt is None:
        return
    newer = [c for c in checkpoints if c.attempt is not None and c.attempt > attempt]
    if newer:
        c = max(newer, key=lambda i: i.attempt or 0)
        raise CheckpointError(
            f"refusing to {action}: {c.path} belongs to attempt {c.attempt}, newer than this "
            f"writer's attempt {attempt} ({ENV_ATTEMPT}); this process is a stale attempt and "
            "must stop"
        )
