"""Checkpoint layout, the completeness rule, listing and rotation decisions (torch-free).

Layout (DESIGN.md)::

    <output_dir>/checkpoint-<global_step>/
        checkpoint-is-incomplete.txt   sentinel: created first, removed last, by the coordinator
        model.safetensors, optimizer.safetensors, trainer_state.json, ...
        manifest.json                  the commit point: files, sizes, checksums, step, attempt, ...

A checkpoint is complete iff ``manifest.json`` exists, the sentinel does not, and every file the
manifest lists exists with its listed size. A stock Hugging Face checkpoint (no manifest) is
complete iff there is no sentinel, ``trainer_state.json`` exists, and none of the files
transformers always writes is missing or empty (:func:`stock_problems`). A directory a resume
found corrupt carries ``checkpoint-is-corrupt.txt`` and is never complete again.

The operator imports this module, so it must never import torch.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import CheckpointError, ConfigurationError, StorageError
from trainer_runtime.protocol import ENV_ATTEMPT

__all__ = [
    "ATTEMPTS_DIR",
    "CHECKPOINT_PREFIX",
    "CORRUPT_NAME",
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
    "mark_corrupt",
    "parse_step",
    "register_attempt",
    "registered_attempts",
    "rotation_victims",
    "stock_problems",
]

SENTINEL_NAME = "checkpoint-is-incomplete.txt"
# Written into a checkpoint that passed the completeness rule but failed verification on resume
# (a checksum mismatch, a listed file gone): it is never complete again, so no reader (resume,
# the operator, rotation's "newest complete") chooses it. JSON: reason, marked_at, attempt, host.
CORRUPT_NAME = "checkpoint-is-corrupt.txt"
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
    # marked corrupt by a resume (CORRUPT_NAME present): never complete, never being written
    corrupt: bool = False

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


# The files transformers.Trainer._save_checkpoint writes that hold the model: one of them (or an
# FSDP / DeepSpeed directory of its own) is in every checkpoint it writes.
_STOCK_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
_STOCK_WEIGHT_DIRS = ("pytorch_model_fsdp", "global_step")
# Files transformers never writes empty (torch.save, safetensors and JSON always have a header):
# an empty one was created but its data never reached the disk (no fsync before a crash).
_NEVER_EMPTY = (".safetensors", ".bin", ".pt", ".pth", ".json")
# "<stem>-00001-of-00003.<ext>": a shard of a sharded file (transformers' and ours)
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.(?P<ext>safetensors|bin)$")
_RNG_RE = re.compile(r"^rng_state_(\d+)\.pth$")


def stock_problems(files: Mapping[str, int]) -> list[str]:
    """Why a directory without our manifest is not a complete stock transformers checkpoint
    (empty list: complete); pure, from the names and sizes alone.

    transformers writes ``trainer_state.json`` last but fsyncs nothing, and its rotation (like
    any recursive delete) unlinks files in directory order, so ``trainer_state.json`` alone
    proves neither that the other files reached the disk nor that none was deleted. What can be
    told from a listing is checked: the state file is there; the model is there (a weights file,
    an index, or an FSDP / DeepSpeed state directory); an index has shards and a sharded file has
    every shard (``-0000i-of-0000n``); ``optimizer.pt`` has its ``scheduler.pt`` (transformers
    always writes both) and ``scheduler.pt`` some optimizer state; per-rank RNG files are
    numbered without gaps; and none of these files is empty. What a listing cannot show (a
    truncated file of the right name, the last rank's RNG file) needs a manifest: checkpoints the
    ``trainer_runtime.hf`` integration commits have one."""
    problems: list[str] = []
    top = {p for p in files if "/" not in p}
    if TRAINER_STATE_NAME not in files:
        return [f"{MANIFEST_NAME} missing (and no {TRAINER_STATE_NAME})"]
    weight_dirs = any(p.split("/", 1)[0].startswith(_STOCK_WEIGHT_DIRS) for p in files if "/" in p)
    if not weight_dirs and not any(name in top for name in _STOCK_WEIGHTS):
        problems.append(
            f"no model weights ({', '.join(_STOCK_WEIGHTS[:2])}, ...) next to "
            f"{TRAINER_STATE_NAME}: save cut short or half removed"
        )
    shards: dict[tuple[str, str, int], set[int]] = {}
    for name in top:
        m = _SHARD_RE.match(name)
        if m:
            key = (m["stem"], m["ext"], int(m["n"]))
            shards.setdefault(key, set()).add(int(m["i"]))
    for (stem, ext, n), have in sorted(shards.items()):
        missing = sorted(set(range(1, n + 1)) - have)
        if missing:
            problems.append(
                f"{len(missing)} of {n} shards of {stem}.{ext} missing "
                f"(e.g. {stem}-{missing[0]:05d}-of-{n:05d}.{ext})"
            )
    for index in sorted(top):
        if index.endswith(".index.json"):
            stem, _, ext = index[: -len(".index.json")].rpartition(".")
            if ext in ("safetensors", "bin") and not any(k[:2] == (stem, ext) for k in shards):
                problems.append(f"{index} present but none of its shards")
    if "optimizer.pt" in top and "scheduler.pt" not in top:
        problems.append("optimizer.pt present but scheduler.pt missing")
    if "scheduler.pt" in top and not any(p.startswith(("optimizer", "global_step")) for p in files):
        problems.append("scheduler.pt present but no optimizer state (optimizer.pt)")
    ranks = sorted(int(m.group(1)) for m in map(_RNG_RE.match, top) if m)
    if ranks and ranks != list(range(ranks[-1] + 1)):
        gaps = sorted(set(range(ranks[-1] + 1)) - set(ranks))
        problems.append(f"rng_state_{gaps[0]}.pth missing (rank files are numbered 0..N-1)")
    for name in sorted(top):
        if files[name] == 0 and name.endswith(_NEVER_EMPTY):
            problems.append(f"file {name} is empty (written but never flushed to disk)")
    return problems


def is_complete(
    files: Mapping[str, int], manifest: Mapping[str, Any] | None
) -> tuple[bool, str | None]:
    """Apply the completeness rule to a checkpoint directory.

    ``files`` maps every file present (path relative to the checkpoint dir) to its size;
    ``manifest`` is the parsed ``manifest.json`` or None when there is none (or it is unreadable).
    Returns ``(complete, reason)``; ``reason`` says why not, None when complete.
    """
    if CORRUPT_NAME in files:
        return False, f"marked corrupt by a resume ({CORRUPT_NAME})"
    if SENTINEL_NAME in files:
        return False, f"sentinel {SENTINEL_NAME} present (save interrupted or still in progress)"
    if manifest is None:
        if MANIFEST_NAME in files:
            return False, f"{MANIFEST_NAME} is unreadable"
        problems = stock_problems(files)  # a stock transformers checkpoint, or nothing
        return (False, "; ".join(problems)) if problems else (True, None)
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


def _abandoned(info: CheckpointInfo, attempt: int | None) -> bool:
    """An incomplete directory no live writer can be writing: marked corrupt by a resume, or
    started by an attempt older than ``attempt`` (the operator never runs two attempts at once,
    and the fence stops an older one before it writes)."""
    if info.complete:
        return False
    if info.corrupt:
        return True
    return attempt is not None and info.attempt is not None and info.attempt < attempt


def rotation_victims(
    checkpoints: Iterable[CheckpointInfo],
    save_total_limit: int | None,
    protect: Iterable[str] = frozenset(),
    attempt: int | None = None,
) -> list[CheckpointInfo]:
    """Which checkpoints rotation removes (oldest first); pure.

    - ``save_total_limit`` None: keep everything (Hugging Face semantics), nothing is removed.
    - The newest complete checkpoint is never removed, nor any checkpoint named in ``protect``
      (names or paths; e.g. the best checkpoint). Protected complete checkpoints count towards the
      limit, like Hugging Face (limit 5 with an older best keeps the best and the 4 newest).
    - Complete checkpoints beyond the limit are removed, oldest first.
    - Incomplete checkpoints older than the newest complete one are abandoned writes and removed;
      incomplete ones newer than it may still be being written and are kept, unless no live
      writer can be writing them: marked corrupt, or started by an attempt older than
      ``attempt`` (this writer's, e.g. a save of the previous attempt that failed or was killed).
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
        and (c.complete or _sort_key(c) < _sort_key(newest) or _abandoned(c, attempt))
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
    corrupt = CORRUPT_NAME in files
    if corrupt:
        why = _corrupt_reason(storage, rel)
        if why:
            reason = f"{reason}: {why}"
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
        corrupt=corrupt,
    )


def _corrupt_reason(storage: Storage, rel: str) -> str | None:
    try:
        data = storage.read_json(f"{rel}/{CORRUPT_NAME}" if rel else CORRUPT_NAME)
    except StorageError:
        return None
    value = data.get("reason") if isinstance(data, dict) else None
    if not isinstance(value, str) or not value:
        return None
    # bounded: the operator copies the reason into the TrainingJob's status
    return value if len(value) <= 1000 else value[:997] + "..."


def mark_corrupt(storage: Storage, rel: str, reason: str, attempt: int | None = None) -> str:
    """Write :data:`CORRUPT_NAME` into the checkpoint directory ``rel`` (durably, through the
    storage seam): from then on the completeness rule says it is not complete, so no resume
    (ours, the hf integration's, the operator's choice) picks it again. Its data is left as it
    is, for inspection; rotation removes it like any abandoned write. Returns its path."""
    rel_marker = f"{rel}/{CORRUPT_NAME}" if rel else CORRUPT_NAME
    storage.write_json(
        rel_marker,
        {
            "reason": reason[:4000],
            "marked_at": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "attempt": attempt,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        },
    )
    storage.fsync_dir(rel)
    return storage.join(rel_marker)


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
                corrupt=CORRUPT_NAME in listed,
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

    def names(self, *, missing_ok: bool = True) -> list[str]:
        """Checkpoint directory names, ascending by step.

        A missing output dir has none (``missing_ok``, what a writer or a resume wants: nothing
        was saved yet). With ``missing_ok=False`` it raises a not-found :class:`StorageError`
        instead: a reader that may see another volume than the writers (the operator) must
        not take "not there" for "empty"."""
        if not self.storage.exists(""):
            if missing_ok:
                return []
            raise StorageError(
                self.storage.url,
                "list checkpoints",
                FileNotFoundError(f"{self.storage.url} does not exist"),
            )
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

    def latest_complete(self, below: int | None = None) -> CheckpointInfo | None:
        """The complete checkpoint with the highest step (lower than ``below`` if given), or
        None."""
        for name in reversed(self.names()):
            step = parse_step(name)
            if below is not None and (step is None or step >= below):
                continue
            info = inspect_checkpoint(self.storage, name)
            if info.complete:
                return info
        return None

    def newest(self, limit: int, *, missing_ok: bool = True) -> list[CheckpointInfo]:
        """The newest checkpoints, newest first, down to and including the newest complete one,
        at most ``limit`` of them.

        One listing of the names, then one inspection (manifest read) per checkpoint returned:
        the cost does not grow with the checkpoints kept (``save_total_limit`` unset keeps them
        all). The last one is the newest complete checkpoint when it is complete; when none of
        the ``limit`` newest is, an older complete one may exist."""
        if limit < 1:
            raise ConfigurationError(f"limit={limit!r} is invalid: use an integer >= 1")
        out: list[CheckpointInfo] = []
        for name in reversed(self.names(missing_ok=missing_ok)):
            info = inspect_checkpoint(self.storage, name)
            out.append(info)
            if info.complete or len(out) >= limit:
                break
        return out

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
