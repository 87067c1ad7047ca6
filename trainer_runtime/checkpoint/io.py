"""Writing and reading checkpoints: safetensors files, the per-rank records, the manifest commit.

Write protocol (every rank calls the same methods in the same order)::

    w = CheckpointWriter(output_dir, step, rank=r, world_size=n, barrier=barrier)
    w.begin()                      # coordinator: dir + sentinel (fsynced); then barrier
    w.write_tensors("model.safetensors", tensors)   # each rank writes its own files (fsynced)
    w.write_json("trainer_state.json", state)
    info = w.commit()              # each rank records its files; barrier; coordinator merges,
                                   # writes manifest.json atomically, removes the sentinel; barrier

``barrier`` is a callable that returns when every rank reached it (e.g.
``torch.distributed.barrier`` or ``accelerator.wait_for_everyone``); with ``world_size == 1`` it is
never needed.

One copy per node (``each_node=True``, the ``save_on_each_node`` argument): for nodes without
shared storage. The main process of every node (``local_rank == 0``) is the coordinator of its
node's copy: it creates that copy's sentinel, writes the shared files (model, optimizer, ...; the
replicas are identical under DDP) and, at commit, the per-rank files of *every* rank, which reach it
through ``gather`` (an all-gather of Python objects, e.g. ``torch.distributed.all_gather_object``),
so each node's copy is self-contained and can resume any rank. Files written by the other ranks of
a node (or with ``per_rank=True``) are these per-rank files. The ranks agree (all-gather of each
rank's outcome) after the sentinels are created, and again after every node wrote all its files:
no node writes its manifest unless every node is ready to; a failure on any node raises on every
rank. A node's copy is valid only with its own manifest.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import load_file as _st_load_file

from trainer_runtime.checkpoint import read_stats
from trainer_runtime.checkpoint.digest import (
    ALGORITHMS,
    file_record,
    hash_stream,
    listed_digest,
    new_hasher,
)
from trainer_runtime.checkpoint.direct_io import DEPTH, staging_pool
from trainer_runtime.checkpoint.direct_read import aligned_empty, close_quietly, open_direct
from trainer_runtime.checkpoint.layout import (
    CORRUPT_NAME,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    PARTIAL_PREFIX,
    SENTINEL_NAME,
    TRAINER_STATE_NAME,
    CheckpointInfo,
    CheckpointStore,
    attempt_from_env,
    checkpoint_name,
    fence_attempts,
    fence_check,
    inspect_checkpoint,
    register_attempt,
    rotation_victims,
)
from trainer_runtime.checkpoint.model_state import OPTIMIZER_INDEX_NAME, OPTIMIZER_NAME
from trainer_runtime.checkpoint.safetensors_stream import (
    Cancelled,
    TensorFile,
    fault_in,
    header_of,
    read_header,
    read_into_buffer,
    read_into_tensors,
    tensors_from_buffer,
    write_safetensors,
)
from trainer_runtime.checkpoint.shares import ShardFile, ShareIndex, load_indexed
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ConfigurationError,
    ResumeError,
    StorageError,
)

__all__ = [
    "OPTIMIZER_META_KEY",
    "CheckpointReader",
    "CheckpointWriter",
    "download_checkpoint",
    "optimizer_state_from_tensors",
    "optimizer_state_to_tensors",
    "remove_checkpoint",
    "rotate_checkpoints",
    "verify_checkpoint",
    "warm_local_writes",
    "write_entry",
]

# safetensors metadata key holding the non-tensor part of an optimizer state_dict
OPTIMIZER_META_KEY = "preemptible.optimizer_meta"
_OPTIMIZER_META_FORMAT = "preemptible-optimizer/1"
_RESERVED_MANIFEST_KEYS = frozenset(
    {
        "format",
        "step",
        "world_size",
        "attempt",
        "save_seconds",
        "created_at",
        "files",
        "node_copy",
        "commit_token",
    }
)

# write_entries: safetensors files at least this large are written concurrently, this many at once
_PARALLEL_MIN_BYTES = 64 << 20
_PARALLEL_FILES = 2
# upload_local_files / download_checkpoint: blocks read from or written to the local copy
_UPLOAD_BLOCK = 8 << 20

logger = logging.getLogger(__name__)

# output dir URL -> attempts this process registered there (layout.register_attempt)
_registered: dict[str, set[int | None]] = {}

Barrier = Callable[[], Any]
# every rank passes its object and gets the list of all ranks' objects, in rank order
Gather = Callable[[Any], list[Any]]


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _node_order(node: str) -> tuple[int, int, str]:
    return (0, int(node), "") if node.isdigit() else (1, 0, node)


def _partial_name(rank: int) -> str:
    return f"{PARTIAL_PREFIX}{rank:05d}.json"


def _check_filename(filename: str) -> str:
    name = filename.strip()
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
        or name in (SENTINEL_NAME, MANIFEST_NAME, CORRUPT_NAME)
        or parts[-1].startswith(PARTIAL_PREFIX)
    ):
        raise ConfigurationError(
            f"checkpoint filename {filename!r} is invalid: use a relative path without '..' "
            f"that is not {SENTINEL_NAME!r}, {MANIFEST_NAME!r}, {CORRUPT_NAME!r} or a "
            f"{PARTIAL_PREFIX!r} record"
        )
    return name


class CheckpointWriter:
    """Writes ``<output_dir>/checkpoint-<step>`` from one rank; see the module docstring.

    ``attempt`` defaults to $PREEMPTIBLE_ATTEMPT. A writer never overwrites or writes next to a
    checkpoint of a newer attempt (CheckpointError): that process is a stale attempt.
    """

    def __init__(
        self,
        output_dir: str,
        step: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        attempt: int | None = None,
        barrier: Barrier | None = None,
        storage_options: dict[str, Any] | None = None,
        each_node: bool = False,
        local_rank: int = 0,
        node: str | None = None,
        gather: Gather | None = None,
    ) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigurationError(f"step={step!r} is invalid: use the global step, an int >= 0")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigurationError(f"world_size={world_size!r} is invalid: use an int >= 1")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigurationError(
                f"rank={rank!r} is invalid: use 0 <= rank < world_size ({world_size})"
            )
        if world_size > 1 and barrier is None:
            raise ConfigurationError(
                f"barrier is required with world_size={world_size}: "
                "pass e.g. torch.distributed.barrier"
            )
        # With one rank there is one node and one copy: the ordinary protocol.
        self.each_node = bool(each_node) and world_size > 1
        if self.each_node and gather is None:
            raise ConfigurationError(
                f"gather is required with each_node=True and world_size={world_size}: pass an "
                "all-gather of objects, e.g. trainer_runtime.checkpoint.per_node.gather_objects"
            )
        if not isinstance(local_rank, int) or local_rank < 0:
            raise ConfigurationError(f"local_rank={local_rank!r} is invalid: use an int >= 0")
        self.local_rank = local_rank
        self.node = str(node) if node is not None else str(rank)
        self._gather = gather
        self._nodes: list[str] = [self.node]
        # per-rank files held until commit (each_node): every node's copy gets every rank's
        self._rank_files: dict[str, bytes] = {}
        self.output_dir = output_dir
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt_from_env(attempt)
        self._barrier = barrier
        self.root = Storage(output_dir, storage_options)
        self.name = checkpoint_name(step)
        self.path = self.root.join(self.name)
        self._files: dict[str, dict[str, Any]] = {}
        self._started: float | None = None
        self._token: str | None = None
        self._committed = False
        # what discard() may remove: the directory only once our own sentinel is in it (or it
        # was created by this writer), and the files this rank started to write
        self._sentinel_ours = False
        self._created = False
        self._marked = False  # a corrupt marker was in the directory: removed at the commit
        self._touched: set[str] = set()
        # Rank-shared groups (shares.py): the tensors of the shards this rank wrote (file ->
        # names, in its record), and on the coordinator the indexes built from every rank's at
        # the commit.
        self._shard_tensors: dict[str, list[str]] = {}
        self._indexes: dict[str, ShareIndex] = {}
        self._written_shards: dict[str, list[str]] = {}
        # Set by another thread to stop a background write between blocks (Cancelled).
        self.cancel: threading.Event | None = None

    @property
    def is_coordinator(self) -> bool:
        """The rank that creates the sentinel and writes the manifest (and the shared files):
        rank 0, or the main process of every node with ``each_node``."""
        return self.local_rank == 0 if self.each_node else self.rank == 0

    def _wait(self) -> None:
        if self.world_size > 1 and self._barrier is not None:
            self._barrier()

    def _rel(self, filename: str) -> str:
        return f"{self.name}/{filename}"

    # -- begin -----------------------------------------------------------------------------------
    def begin(self) -> None:
        """Coordinator: fence, create the dir + sentinel (fsynced); then all ranks barrier."""
        if self._started is not None:
            raise CheckpointError(f"begin() called twice for {self.path}")
        self._started = time.monotonic()
        if self.each_node:
            self._begin_each_node()
            return
        error: BaseException | None = None
        if self.is_coordinator:
            try:
                self._begin_coordinator()
            except BaseException as exc:  # the other ranks must not hang in the barrier
                error = exc
        self._wait()
        if error is not None:
            raise error
        if not self.is_coordinator and not self.root.exists(self._rel(SENTINEL_NAME)):
            raise CheckpointError(
                f"rank {self.rank}: the coordinator did not start checkpoint {self.path} "
                f"(no {SENTINEL_NAME}); see rank 0's error"
            )

    def _begin_coordinator(self) -> None:
        action = f"write {self.path}"
        if not self.root.is_object_store:
            # a look into every checkpoint: cheap on a disk (and on the in-memory store)
            store = CheckpointStore(self.output_dir, self.root.storage_options)
            fence_check(store.list(), self.attempt, action)
        else:
            # object stores: one listing of the registered attempts, however many checkpoints
            # there are (a JIT save must not pay requests per checkpoint); then register ours
            fence_attempts(self.root, self.attempt, action)
            if self.attempt not in _registered.get(self.root.url, ()):
                register_attempt(self.root, self.attempt, socket.gethostname())
                _registered.setdefault(self.root.url, set()).add(self.attempt)
        existed = self.root.exists(self.name)
        replaced = inspect_checkpoint(self.root, self.name) if existed else None
        self.root.makedirs(self.name)
        self._created = not existed
        self._token = uuid.uuid4().hex
        sentinel = {
            "attempt": self.attempt,
            "step": self.step,
            "world_size": self.world_size,
            "started_at": _utc_now(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "token": self._token,
        }
        if self.each_node:
            sentinel["node"] = self.node
        # The sentinel goes first: from here on the directory reads as incomplete.
        self.root.write_json(self._rel(SENTINEL_NAME), sentinel)
        self._sentinel_ours = True
        self.root.fsync_dir(self.name)
        self.root.fsync_dir("")
        if existed:
            # A rewrite of the same step (e.g. a resumed attempt saving where the previous one
            # stopped): drop everything the earlier writer left, now that the sentinel protects it.
            # A complete checkpoint of this step is only ever rewritten by a run that started
            # fresh (transformers' behaviour: another trajectory's state, which this one
            # replaces): our Trainer skips the save of the step it resumed from or saved, and
            # after a resume keeps complete checkpoints of later steps (Trainer._kept_checkpoint).
            if replaced is not None and replaced.complete:
                logger.warning(
                    "replacing the complete checkpoint %s (attempt %s) with this run's state "
                    "of step %d: this run did not resume from it",
                    self.path,
                    replaced.attempt,
                    self.step,
                )
            # A corrupt marker stays until this checkpoint is committed: if this rewrite is cut
            # short, the directory still reads as the corrupt one (whatever an operator's
            # resume path to it falls back from), not as an ordinary half-written save.
            for rel in self.root.walk_files(self.name):
                if rel == CORRUPT_NAME:
                    self._marked = True
                elif rel != SENTINEL_NAME:
                    self.root.remove(self._rel(rel))
            self.root.fsync_dir(self.name)

    # -- writes ----------------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._started is None:
            raise CheckpointError(f"call begin() before writing files to {self.path}")
        if self._committed:
            raise CheckpointError(f"{self.path} is already committed")

    def write_bytes(self, filename: str, data: bytes, *, per_rank: bool = False) -> None:
        """Write a file of this rank (flushed and fsynced; size and checksum recorded).

        ``per_rank``: a file only this rank has (its RNG state). With ``each_node`` such files,
        and every file of a rank that is not its node's main process, are held until
        :meth:`commit`, which gives them to every node's coordinator to write.
        """
        self._require_open()
        name = _check_filename(filename)
        if name in self._files or name in self._rank_files:
            raise CheckpointError(f"{name} written twice to {self.path}")
        if self.each_node and (per_rank or not self.is_coordinator):
            self._rank_files[name] = bytes(data)
            return
        self._write_file(name, data)

    def _write_file(self, name: str, data: bytes) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled()
        self._touched.add(name)
        size, digest = self.root.write_bytes(self._rel(name), data)
        self._files[name] = file_record(name, size, digest)

    def write_tensors(
        self,
        filename: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: Mapping[str, str] | None = None,
        *,
        per_rank: bool = False,
    ) -> None:
        """Write tensors as one safetensors file (``per_rank``: see :meth:`write_bytes`).

        The file is written as it is serialised, tensor by tensor from the tensors' own memory
        (safetensors_stream): no copy of the file is built in memory; tensors on an accelerator
        are copied to the host one at a time."""
        self._require_open()
        name = _check_filename(filename)
        if name in self._files or name in self._rank_files:
            raise CheckpointError(f"{name} written twice to {self.path}")
        meta = dict(metadata) if metadata else None
        if self.each_node and (per_rank or not self.is_coordinator):
            try:
                self._rank_files[name] = TensorFile(tensors, meta).to_bytes()
            except CheckpointError as exc:
                raise CheckpointError(
                    f"cannot serialise tensors for {self._rel(name)}: {exc}"
                ) from exc
            return
        self._touched.add(name)
        try:
            with self.root.open_write(self._rel(name)) as fh:
                write_safetensors(fh.write, tensors, meta, cancel=self.cancel)
        except StorageError:
            raise
        except CheckpointError as exc:
            raise CheckpointError(f"cannot serialise tensors for {self._rel(name)}: {exc}") from exc
        self._files[name] = file_record(name, fh.size, fh.digest)

    def write_entry(
        self, filename: str, data: bytes | TensorFile | ShareIndex, *, per_rank: bool = False
    ) -> None:
        """Write bytes or a :class:`TensorFile` (e.g. an entry of
        :func:`~trainer_runtime.checkpoint.hf_format.model_file_entries`). A ShareIndex (the
        coordinator's entry of shares.share_entries) is written at the commit, built from the
        shards every rank wrote."""
        if isinstance(data, ShareIndex):
            self._require_open()
            name = _check_filename(filename)
            if name in self._files or name in self._rank_files or name in self._indexes:
                raise CheckpointError(f"{name} written twice to {self.path}")
            if self.each_node or not self.is_coordinator:
                raise ConfigurationError(
                    f"{name}: a shared group's index is written by the coordinator of a single "
                    "copy (rank 0, save_on_each_node=False)"
                )
            self._indexes[name] = data
            return
        if isinstance(data, TensorFile):
            self.write_tensors(filename, data.tensors, data.metadata, per_rank=per_rank)
            if isinstance(data, ShardFile):
                self._shard_tensors[_check_filename(filename)] = list(data.tensors)
        else:
            self.write_bytes(filename, data, per_rank=per_rank)

    def write_entries(self, entries: Iterable[tuple[str, Any, bool]]) -> None:
        """Write several entries ``(name, data, per_rank)``; ``data`` is bytes, a TensorFile or
        a callable returning either (built when written, after every other entry).

        Large safetensors files (the model's and the optimizer's) are written at the same time
        on helper threads: each file's checksum runs on one core, so two files hash on two cores
        while the disk writes both. The other entries follow in order, once those are written.
        """
        entries = list(entries)
        big = [
            e
            for e in entries
            if isinstance(e[1], TensorFile) and e[1].nbytes >= _PARALLEL_MIN_BYTES
        ]
        names = [e[0] for e in entries]
        if len(big) < 2 or len(set(names)) != len(names):
            big = []  # (a duplicate name raises in order, as write_entry always did)
        if big:
            with ThreadPoolExecutor(
                max_workers=_PARALLEL_FILES, thread_name_prefix="ckpt-file"
            ) as pool:
                futures = [pool.submit(self.write_entry, n, d, per_rank=r) for n, d, r in big]
            # every thread has ended (the pool's exit waits): none writes on after an error
            for future in futures:
                future.result()
        done = {id(e) for e in big}
        for entry in entries:
            if id(entry) not in done:
                name, data, per_rank = entry
                self.write_entry(name, data() if callable(data) else data, per_rank=per_rank)

    def write_json(self, filename: str, obj: Any, *, per_rank: bool = False) -> None:
        data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
        self.write_bytes(filename, data, per_rank=per_rank)

    def write_optimizer_state(self, filename: str, state_dict: Mapping[str, Any]) -> None:
        """An optimizer state_dict as one safetensors file (non-tensor parts in its metadata)."""
        tensors, meta = optimizer_state_to_tensors(state_dict)
        self.write_tensors(filename, tensors, metadata={OPTIMIZER_META_KEY: meta})

    def sync_present(self) -> list[str]:
        """fsync every file now in the checkpoint directory (written by another library's save,
        e.g. transformers.Trainer._save_checkpoint); returns their relative paths. Every rank
        calls it for the files it may have written, before the barrier that precedes
        :meth:`adopt_present`."""
        self._require_open()
        present = sorted(self.root.walk_files(self.name))
        for rel in present:
            self.root.fsync_file(self._rel(rel))
        self.root.fsync_dir(self.name)
        return present

    def present_files(self) -> dict[str, int]:
        """Files already in the directory that this writer did not write itself (written by
        another library's save) and that belong to the checkpoint: path -> size."""
        self._require_open()
        present: dict[str, int] = {}
        for rel, size in sorted(self.root.walk_files(self.name).items()):
            base = rel.rsplit("/", 1)[-1]
            if rel in (SENTINEL_NAME, MANIFEST_NAME, CORRUPT_NAME) or base.startswith(
                PARTIAL_PREFIX
            ):
                continue
            if base.startswith(".") and ".tmp-" in base:
                continue  # an atomic write's temporary file, not part of the checkpoint
            if rel not in self._files:
                present[rel] = size
        return present

    def adopt(self, files: Mapping[str, int], *, checksum: bool = True) -> list[str]:
        """Record files another library wrote (e.g. from :meth:`present_files`) so the
        manifest lists them: their size, and with ``checksum`` their checksum read back from
        storage. ``checksum=False`` records the size only (a JIT save, where reading the whole
        checkpoint back would take much of the grace period); readers then check the size.
        Every file must be adopted by exactly one rank."""
        self._require_open()
        for rel in sorted(files):
            if checksum:
                size, digest = self.root.hash_file(self._rel(rel))
                self._files[rel] = file_record(rel, size, digest)
            else:
                self._files[rel] = {"path": rel, "size": int(files[rel])}
        return sorted(files)

    def upload_local_files(self, files: Mapping[str, str]) -> list[str]:
        """Write files another library saved on a local disk (name in the checkpoint -> local
        path) into this checkpoint, e.g. transformers' save into a scratch directory when the
        checkpoint lives on an object store. Each is streamed as it is read (a multipart upload
        there), its checksum computed on the way, two large files at a time. Returns the names.
        """
        self._require_open()
        names = sorted(files, key=lambda n: -os.path.getsize(files[n]))
        for name in names:
            _check_filename(name)
            if name in self._files:
                raise CheckpointError(f"{name} written twice to {self.path}")

        def upload(name: str) -> None:
            self._touched.add(name)
            with (
                open(files[name], "rb", buffering=0) as src,
                self.root.open_write(self._rel(name)) as fh,
            ):
                while block := src.read(_UPLOAD_BLOCK):
                    fh.write(block)
            self._files[name] = file_record(name, fh.size, fh.digest)

        with ThreadPoolExecutor(max_workers=_PARALLEL_FILES, thread_name_prefix="ckpt-up") as pool:
            futures = [pool.submit(upload, name) for name in names]
        for future in futures:  # every upload has ended: none goes on after an error
            future.result()
        return names

    def adopt_present(self) -> list[str]:
        """Coordinator: :meth:`adopt` every file of :meth:`present_files`, checksums read back.
        Call it after every rank's :meth:`sync_present` and a barrier."""
        return self.adopt(self.present_files())

    @property
    def files(self) -> list[dict[str, Any]]:
        """The files this rank wrote so far: path, size, checksum."""
        return [dict(v) for v in self._files.values()]

    # -- commit ----------------------------------------------------------------------------------
    def commit(self, extra_manifest: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Record this rank's files; barrier; coordinator writes the manifest, removes the sentinel.

        Returns the committed checkpoint's info on every rank; raises CheckpointError (on every
        rank) when it could not be committed. The previous checkpoints are left untouched.
        """
        self._require_open()
        extra = dict(extra_manifest or {})
        clash = _RESERVED_MANIFEST_KEYS & set(extra)
        if clash:
            raise ConfigurationError(
                f"extra_manifest keys {sorted(clash)} are reserved by the manifest: rename them"
            )
        if self.each_node:
            return self._commit_each_node(extra)
        error: BaseException | None = None
        if self.world_size > 1 and not self.is_coordinator:  # the coordinator has its own in memory
            try:
                record = {
                    "rank": self.rank,
                    "attempt": self.attempt,
                    "files": self.files,
                    # the tensors of its shards: the coordinator builds the indexes from them
                    "shard_tensors": self._shard_tensors,
                }
                self.root.write_json(self._rel(_partial_name(self.rank)), record)
            except BaseException as exc:
                error = exc
        self._wait()
        info: CheckpointInfo | None = None
        if self.is_coordinator:
            try:
                if error is None:
                    info = self._commit_coordinator(extra)
            except BaseException as exc:
                error = exc
        self._wait()
        self._committed = True
        if error is not None:
            raise error
        if info is None:
            info = inspect_checkpoint(self.root, self.name)
            if not info.complete:
                raise CheckpointError(
                    f"rank {self.rank}: checkpoint {self.path} was not committed ({info.reason}); "
                    "see rank 0's error"
                )
        return info

    def _commit_coordinator(self, extra: dict[str, Any]) -> CheckpointInfo:
        merged = self._merge_records()
        self._write_indexes(merged)
        return self._publish_manifest(self._prepare_manifest(extra, merged))

    def _write_indexes(self, merged: dict[str, dict[str, Any]]) -> None:
        """Coordinator, every rank's record merged: write each shared group's index from the
        shards the ranks wrote (not from its own plan), and add it to the files to commit."""
        for name, index in sorted(self._indexes.items()):
            data = index.build(self._written_shards, f"{self.path}/{name}")
            self._write_file(name, data)
            entry = self._files[name]
            merged[name] = {k: v for k, v in entry.items() if k in ("path", "size", *ALGORITHMS)}

    def _merge_records(self) -> dict[str, dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        owners: dict[str, int] = {}
        self._written_shards = {}
        for rank in range(self.world_size):
            if rank == 0:
                files = self.files
                self._written_shards.update(self._shard_tensors)
            else:
                rel = self._rel(_partial_name(rank))
                try:
                    record = self.root.read_json(rel)
                except StorageError as exc:
                    raise CheckpointError(
                        f"rank {rank} did not record its files for {self.path}: {exc}"
                    ) from exc
                if record.get("attempt") != self.attempt:
                    raise CheckpointError(
                        f"rank {rank} recorded attempt {record.get('attempt')} for {self.path}, "
                        f"the coordinator runs attempt {self.attempt}"
                    )
                files = record.get("files", [])
                shards = record.get("shard_tensors") or {}
                if isinstance(shards, dict):
                    self._written_shards.update({str(k): list(v) for k, v in shards.items()})
            for entry in files:
                if entry["path"] in merged:
                    raise CheckpointError(
                        f"file {entry['path']} of {self.path} written by ranks "
                        f"{owners[entry['path']]} and {rank}: give each rank its own file names"
                    )
                merged[entry["path"]] = {
                    k: v for k, v in entry.items() if k in ("path", "size", *ALGORITHMS)
                }
                owners[entry["path"]] = rank
        return merged

    def _prepare_manifest(
        self, extra: dict[str, Any], merged: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        """Check the files on storage against the records and that the sentinel is still ours;
        the manifest to write."""
        present = self.root.walk_files(self.name)
        for entry in merged.values():
            if present.get(entry["path"]) != entry["size"]:
                raise CheckpointError(
                    f"file {entry['path']} of {self.path} is {present.get(entry['path'])} bytes on "
                    f"storage, the writer recorded {entry['size']}"
                )
        self._check_still_ours()
        if not self.each_node:
            for rank in range(1, self.world_size):
                self.root.remove(self._rel(_partial_name(rank)))
        assert self._started is not None
        save_seconds = time.monotonic() - self._started
        manifest = {
            **extra,
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "attempt": self.attempt,
            "save_seconds": round(save_seconds, 6),
            "created_at": _utc_now(),
            "files": sorted(merged.values(), key=lambda e: e["path"]),
            # this save's own token (the sentinel's): a conditional create refused because the
            # manifest exists is ours when it carries it (_publish_manifest)
            "commit_token": self._token,
        }
        if self.each_node:
            manifest["node_copy"] = {
                "node": self.node,
                "nodes": list(self._nodes),
                "writer_rank": self.rank,
            }
        return manifest

    def _publish_manifest(self, manifest: dict[str, Any]) -> CheckpointInfo:
        self.root.fsync_dir(self.name)
        # The commit point, then the sentinel goes (last); a crash in between leaves an incomplete
        # checkpoint, never a complete-looking partial one. On object stores a conditional
        # create (If-None-Match): of two writers that both passed the sentinel check, one
        # commits and the other gets CheckpointError.
        try:
            self.root.atomic_write_json(self._rel(MANIFEST_NAME), manifest, exclusive=True)
        except StorageError as exc:
            if not isinstance(exc.cause, FileExistsError):
                raise
            if not self._manifest_is_ours(manifest, exc):
                raise CheckpointError(
                    f"{self.path}/{MANIFEST_NAME} was written by another writer first: "
                    "checkpoint not committed by this one"
                ) from exc
        if self._marked:
            try:
                self.root.remove(self._rel(CORRUPT_NAME))
            except StorageError as exc:
                if not exc.not_found:
                    raise
        self.root.remove(self._rel(SENTINEL_NAME))
        self.root.fsync_dir(self.name)
        info = inspect_checkpoint(self.root, self.name)
        if not info.complete:
            raise CheckpointError(
                f"checkpoint {self.path} is not complete after commit: {info.reason}"
            )
        return info

    def _manifest_is_ours(self, manifest: Mapping[str, Any], refused: StorageError) -> bool:
        """The conditional create of the manifest was refused because it exists: whether the
        manifest there is the one this writer sent. It is when an earlier try of the same
        request was done by the store but its response was lost (a connection reset, a
        timeout): the client's retry then meets our own manifest (HTTP 412). Told apart from
        another writer's by this save's token. An unreadable manifest raises CheckpointError:
        whether this save committed is not known, so it is not reported as another writer's."""
        try:
            there = self.root.read_json(self._rel(MANIFEST_NAME))
        except StorageError as exc:
            raise CheckpointError(
                f"{self.path}/{MANIFEST_NAME} exists ({refused}) but cannot be read back to "
                f"tell whether this writer's own earlier try wrote it: {exc}"
            ) from exc
        token = manifest.get("commit_token")
        if not (isinstance(there, dict) and token and there.get("commit_token") == token):
            return False
        logger.warning(
            "%s/%s: the store refused the manifest as existing, and the manifest there is this "
            "save's own (a retry after an earlier try's response was lost): committed",
            self.path,
            MANIFEST_NAME,
        )
        return True

    # -- a failed save ---------------------------------------------------------------------------
    def discard(self, *, every_rank_done: bool = False) -> list[str]:
        """After a failed (or abandoned) save: remove what it left, so that a partial checkpoint
        does not keep holding the space (on a full disk it would, and every later save would
        fail the same way). Best effort: never raises, logs what it did or could not do.
        Returns the removed paths.

        The coordinator removes the whole directory (:func:`remove_checkpoint`: never a
        complete-looking state on the way) when no other rank can still be writing into it
        (``world_size`` 1, or ``every_rank_done``: the caller knows every rank's writes ended),
        and only while the sentinel in it is the one it created (never a directory another
        writer took over, nor an earlier checkpoint of this step whose sentinel was never
        replaced by ours). Otherwise each rank removes the files it started to write; the
        directory keeps its sentinel and is removed by rotation once it is abandoned. A
        committed checkpoint is never touched."""
        removed: list[str] = []
        try:
            if self._committed and inspect_checkpoint(self.root, self.name).complete:
                return []
            if self.is_coordinator and (self.world_size == 1 or every_rank_done):
                if self._sentinel_ours and self._sentinel_still_ours():
                    remove_checkpoint(self.root, self.name, self.attempt, sentinel_present=True)
                    removed.append(self.path)
                elif self._created and not self._sentinel_ours:
                    self.root.rm_tree(self.name)  # created here, no sentinel ever written
                    removed.append(self.path)
                if removed:
                    self.root.fsync_dir("")
            else:
                for name in sorted(self._touched):
                    try:
                        self.root.remove(self._rel(name))
                    except StorageError as exc:
                        if not exc.not_found:
                            raise
                        continue
                    removed.append(self.root.join(self._rel(name)))
        except Exception as exc:
            logger.warning(
                "could not remove the partial checkpoint %s of the failed save: %s", self.path, exc
            )
            return removed
        if removed:
            logger.warning(
                "removed the partial checkpoint %s of the failed save (%d path(s)), so that it "
                "does not hold the space",
                self.path,
                len(removed),
            )
        return removed

    def _sentinel_still_ours(self) -> bool:
        try:
            sentinel = self.root.read_json(self._rel(SENTINEL_NAME))
        except StorageError:
            return False
        return isinstance(sentinel, dict) and sentinel.get("token") == self._token

    # -- one copy per node ---------------------------------------------------------------------
    def _agree(self, phase: str, error: BaseException | None) -> list[Any]:
        """All-gather every rank's outcome of ``phase``; raise on every rank if any failed."""
        assert self._gather is not None
        mine = None if error is None else f"{type(error).__name__}: {error}"
        outcomes = self._gather((self.node, self.rank, mine))
        failed = [(node, rank, msg) for node, rank, msg in outcomes if msg is not None]
        if error is not None:
            raise error
        if failed:
            where = "; ".join(f"node {node} (rank {rank}): {msg}" for node, rank, msg in failed)
            raise CheckpointError(f"checkpoint {self.name}: {phase} failed on {where}")
        return outcomes

    def _begin_each_node(self) -> None:
        error: BaseException | None = None
        if self.is_coordinator:
            try:
                self._begin_coordinator()
            except BaseException as exc:  # the other ranks must not hang in the gather
                error = exc
        outcomes = self._agree("begin", error)
        self._nodes = sorted({str(node) for node, _, _ in outcomes}, key=_node_order)
        # Every node's sentinel exists now: a node whose sentinel was replaced by another node's
        # shares its storage with it (nothing has been written yet).
        if self.is_coordinator:
            try:
                self._check_not_shared()
            except BaseException as exc:
                error = exc
        self._agree("begin", error)

    def _commit_each_node(self, extra: dict[str, Any]) -> CheckpointInfo:
        # Every rank's per-rank files reach every node's coordinator.
        assert self._gather is not None
        gathered = self._gather((self.rank, sorted(self._rank_files.items())))
        manifest: dict[str, Any] | None = None
        error: BaseException | None = None
        if self.is_coordinator:
            try:
                owners: dict[str, int] = {}
                for rank, files in gathered:
                    for name, data in files:
                        if name in owners or name in self._files:
                            raise CheckpointError(
                                f"file {name} of {self.path} written by ranks "
                                f"{owners.get(name, self.rank)} and {rank}: give each rank its "
                                "own file names"
                            )
                        owners[name] = rank
                        self._write_file(name, data)
                manifest = self._prepare_manifest(extra, {e["path"]: e for e in self.files})
            except BaseException as exc:
                error = exc
        # No node commits unless every node wrote all of its files.
        self._agree("write", error)
        info: CheckpointInfo | None = None
        if self.is_coordinator:
            assert manifest is not None
            try:
                info = self._publish_manifest(manifest)
            except BaseException as exc:
                error = exc
        self._committed = True
        self._agree("commit", error)
        if info is None:
            info = inspect_checkpoint(self.root, self.name)
            if not info.complete:
                raise CheckpointError(
                    f"rank {self.rank}: the copy of node {self.node} at {self.path} was not "
                    f"committed ({info.reason})"
                )
        return info

    def _check_not_shared(self) -> None:
        """each_node, right after every node created its sentinel: ours must still be there."""
        try:
            sentinel = self.root.read_json(self._rel(SENTINEL_NAME))
        except StorageError:
            sentinel = None  # unreadable: two writers wrote it at once
        if isinstance(sentinel, dict) and sentinel.get("token") == self._token:
            return
        other = sentinel.get("node") if isinstance(sentinel, dict) else None
        by = f"node {other}" if other is not None else "another writer"
        raise CheckpointError(
            f"save_on_each_node=True, but the sentinel node {self.node} created in {self.path} "
            f"was replaced by {by}: output_dir is storage the nodes share, where their copies "
            "would overwrite each other; use save_on_each_node=False with shared storage (one "
            "copy, committed by rank 0), or give each node its own disk"
        )

    def _check_still_ours(self) -> None:
        try:
            sentinel = self.root.read_json(self._rel(SENTINEL_NAME))
        except StorageError as exc:
            raise CheckpointError(
                f"the sentinel of {self.path} vanished during the save: another writer took over"
            ) from exc
        if not isinstance(sentinel, dict) or sentinel.get("token") != self._token:
            raise CheckpointError(
                f"{self.path} was taken over by another writer (attempt "
                f"{sentinel.get('attempt') if isinstance(sentinel, dict) else '?'}) during the save"
            )


class CheckpointReader:
    """Reads a complete checkpoint; opening an incomplete one raises ResumeError with the reason."""

    def __init__(
        self, path: str, storage_options: dict[str, Any] | None = None, *, verify: bool = True
    ) -> None:
        self.path = path
        self.storage = Storage(path, storage_options)
        self.verify = verify
        try:
            info = inspect_checkpoint(self.storage, "")
        except StorageError as exc:
            raise ResumeError(f"cannot resume from {path}: {exc}") from exc
        if not info.complete:
            raise ResumeError(f"cannot resume from {path}: checkpoint incomplete: {info.reason}")
        self.info = info
        listed = (info.manifest or {}).get("files", [])
        self._digests = {e["path"]: listed_digest(e) for e in listed}
        self._sizes: dict[str, int] = {
            e["path"]: e["size"] for e in listed if isinstance(e.get("size"), int)
        }
        # checksums computed on helper threads while the tensors are loaded (wait_verified)
        self._checks: list[tuple[str, Future[str], tuple[str, str]]] = []
        # object stores: files to check that no whole-file load has checked yet
        self._remote_pending: set[str] = set()
        self._pool: ThreadPoolExecutor | None = None
        # owned loads' host buffers, faulted in ahead on a helper until read (prepare_owned)
        self._prepared: dict[str, torch.Tensor] = {}
        self._faulting: list[tuple[threading.Event, Future[bool]]] = []

    @property
    def step(self) -> int:
        return self.info.step

    def _helpers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-verify")
        return self._pool

    def prepare_owned(self, filename: str) -> None:
        """Allocate the host buffer a later ``load_tensors_and_metadata(filename, owned=True)``
        reads into and start faulting its pages in on a helper thread (:func:`fault_in`, last
        page first): for the optimizer file while the model file is read (the first touch of
        800 MB of fresh memory took 0.23-0.40 s of a resume at 100M parameters). The load reads
        into it front to back while the helper is still at work (it never writes the bytes).
        Local storage only; the buffer is used only if the file still has that size when it is
        read, and dropped at :meth:`wait_verified` if it was never used. Costs no extra memory:
        the load allocates the same bytes, only earlier."""
        path = self._local_path(filename)
        if path is None or filename in self._prepared:
            return
        try:
            size = os.path.getsize(path)
            buf = aligned_empty(size)  # page-aligned: a cold file is read into it with O_DIRECT
        except (OSError, RuntimeError):
            return  # the load reports it (a missing file, no memory)
        stop = threading.Event()
        self._prepared[filename] = buf
        self._faulting.append((stop, self._helpers().submit(fault_in, buf, stop)))

    def _prepared_buffer(self, filename: str, size: int) -> torch.Tensor | None:
        buf = self._prepared.pop(filename, None)
        return buf if buf is not None and buf.numel() == size else None

    def _stop_faulting(self) -> None:
        faulting, self._faulting = self._faulting, []
        for stop, future in faulting:
            stop.set()
            future.result()  # the helper holds the buffer until it returns

    def _expected(self, filename: str) -> tuple[str, str] | None:
        """(algorithm, digest) the manifest lists for ``filename``; None: nothing to check."""
        return self._digests.get(filename) if self.verify else None

    def _local_path(self, filename: str) -> str | None:
        return self.storage._path(filename) if self.storage.is_local else None

    def load_tensors_and_metadata(
        self,
        filename: str,
        *,
        owned: bool = False,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A safetensors file's tensors and ``__metadata__``, without reading it into bytes.

        Local storage: ``owned=False`` memory-maps the file (the tensors are copy-on-write views
        of its pages: for weights that are copied into parameters right away); ``owned=True``
        reads it on two threads into one host buffer the tensors are views of (for state kept as
        is, e.g. the optimizer's). The checksum listed in the manifest is computed meanwhile (on
        a helper thread for a mapped file; block by block as they arrive for a read one);
        :meth:`wait_verified` raises ResumeError on a mismatch. Object stores: downloaded and
        checked inline.

        ``into`` (local storage): tensors to read the file's tensors of the same name straight
        into (e.g. the model's own state_dict; :func:`read_into_tensors`), in one sequential pass
        that also feeds the checksum; the returned dict holds those very tensors, so loading
        them into the model copies nothing. Tensors that do not fit get new memory.
        """
        path = self._local_path(filename)
        if path is None:
            return self._load_remote(filename)
        expected = self._expected(filename)
        try:
            if into is not None:
                hasher = new_hasher(expected[0]) if expected else None
                size = os.path.getsize(path)
                with open(path, "rb", buffering=0) as fh:
                    # one stream in file order: let the kernel read ahead far (cold files)
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    header, tensors = read_into_tensors(
                        fh.fileno(), size, into, hasher.update if hasher else None
                    )
                read_stats.add(size)
                if hasher is not None:
                    assert expected is not None
                    done_: Future[str] = Future()
                    done_.set_result(hasher.hexdigest())
                    self._checks.append((filename, done_, expected))
            elif not owned:
                tensors = dict(_st_load_file(path))
                # mapped, not read through the seam: counted once (the copies into the
                # parameters and the checksum touch the same pages)
                read_stats.add(os.path.getsize(path))
                with open(path, "rb") as fh:
                    header, _ = read_header(fh)
                if expected:
                    self._checks.append(
                        (
                            filename,
                            self._helpers().submit(_digest_of_file, path, expected[0]),
                            expected,
                        )
                    )
            else:
                # blocks are hashed in file order on this thread while the reader threads
                # read the next ones (the hash releases the GIL)
                hasher = new_hasher(expected[0]) if expected else None
                size = os.path.getsize(path)
                prepared = filename in self._prepared
                out = self._prepared_buffer(filename, size)
                # a cold file: from the disk straight into the buffer (direct_read.py)
                direct_fd = open_direct(path, size)
                if direct_fd is not None and out is None:
                    out = aligned_empty(size)
                try:
                    with open(path, "rb", buffering=0) as fh:
                        buf = read_into_buffer(
                            fh,
                            size,
                            hasher.update if hasher else None,
                            out=out,
                            direct_fd=direct_fd,
                        )
                finally:
                    close_quietly(direct_fd)
                    if prepared:
                        self._stop_faulting()  # what it did not reach, the read faulted
                read_stats.add(size)
                header, base = header_of(memoryview(buf.numpy()))
                tensors = tensors_from_buffer(buf, header, base)
                if hasher is not None:
                    assert expected is not None
                    done: Future[str] = Future()
                    done.set_result(hasher.hexdigest())
                    self._checks.append((filename, done, expected))
        except (OSError, ValueError, CheckpointError) as exc:
            raise ResumeError(f"cannot read {filename} of {self.path}: {exc}") from exc
        except Exception as exc:  # safetensors' own errors (a corrupt header)
            raise ResumeError(f"cannot read {filename} of {self.path}: {exc}") from exc
        return tensors, dict(header.get("__metadata__") or {})

    def _load_remote(self, filename: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """Object stores: parallel ranged reads into one host buffer the tensors are views of;
        the checksum is computed from the blocks in file order while later ranges are still
        downloading (:meth:`Storage.read_into`); :meth:`wait_verified` reports it."""
        expected = self._expected(filename)
        hasher = new_hasher(expected[0]) if expected else None
        try:
            size = self._sizes.get(filename)
            if size is None:
                size = self.storage.size(filename)
            buf = torch.empty(size, dtype=torch.uint8)
            self.storage.read_into(
                filename, memoryview(buf.numpy()), hasher.update if hasher else None
            )
            header, base = header_of(memoryview(buf.numpy()))
            tensors = tensors_from_buffer(buf, header, base)
        except StorageError as exc:
            raise ResumeError(f"cannot read {filename} of {self.path}: {exc}") from exc
        except Exception as exc:  # a corrupt header, safetensors' own errors
            raise ResumeError(f"cannot read {filename} of {self.path}: {exc}") from exc
        if hasher is not None:
            assert expected is not None
            done: Future[str] = Future()
            done.set_result(hasher.hexdigest())
            self._checks.append((filename, done, expected))
            self._remote_pending.discard(filename)
        return tensors, dict(header.get("__metadata__") or {})

    def verify_in_background(self, filename: str) -> None:
        """Check ``filename`` against the manifest on a helper thread (for a file read some
        other way, e.g. in slices); :meth:`wait_verified` reports the outcome."""
        expected = self._expected(filename)
        if not expected:
            return
        path = self._local_path(filename)
        future: Future[str]
        if path is not None:
            future = self._helpers().submit(_digest_of_file, path, expected[0])
        else:
            # Object stores: a file loaded whole later (_load_remote) is checked as it downloads;
            # only one that never is gets downloaded again for its checksum (wait_verified).
            self._remote_pending.add(filename)
            return
        self._checks.append((filename, future, expected))

    def _remote_digest(self, filename: str, algorithm: str) -> str:
        with self.storage.open_read(filename) as fh:
            return hash_stream(fh, algorithm)[1]

    def wait_verified(self) -> None:
        """Wait for the checksums computed beside the loading; ResumeError on a mismatch."""
        for filename in sorted(self._remote_pending):
            expected = self._expected(filename)
            if expected:
                future = self._helpers().submit(self._remote_digest, filename, expected[0])
                self._checks.append((filename, future, expected))
        self._remote_pending.clear()
        self._prepared.clear()  # never loaded: its memory goes
        self._stop_faulting()
        checks, self._checks = self._checks, []
        try:
            for filename, future, (algorithm, expected) in checks:
                try:
                    actual = future.result()
                except OSError as exc:
                    raise ResumeError(f"cannot read {filename} of {self.path}: {exc}") from exc
                if actual != expected:
                    raise self._corrupt(filename, algorithm, actual, expected)
        finally:
            if self._pool is not None and not self._checks:
                self._pool.shutdown(wait=True)
                self._pool = None

    def verify_all(self) -> None:
        """Check the whole checkpoint against its manifest now: it still passes the completeness
        rule (every listed file present with its size, manifest readable) and every listed
        checksum matches the file's bytes, read back. CheckpointCorruptError naming the file
        and both digests (or the rule's reason) when not; ResumeError when storage cannot be
        read (not a verdict: e.g. a network error). A stock transformers checkpoint has nothing
        to check beyond the rule. Reads every file: for deciding, after a load failed, whether
        the checkpoint is corrupt."""
        try:
            info = inspect_checkpoint(self.storage, "")
        except StorageError as exc:
            raise ResumeError(f"cannot inspect {self.path}: {exc}") from exc
        if not info.complete:
            raise CheckpointCorruptError(
                f"{self.path} no longer passes the completeness rule: {info.reason}"
            )
        for entry in (info.manifest or {}).get("files", []):
            expected = listed_digest(entry)
            if not expected:
                continue  # sizes only: the rule checked them
            name = entry["path"]
            try:
                with self.storage.open_read(name) as fh:
                    _, actual = hash_stream(fh, expected[0])
            except (StorageError, OSError) as exc:
                if (isinstance(exc, StorageError) and exc.not_found) or isinstance(
                    exc, FileNotFoundError
                ):
                    raise CheckpointCorruptError(
                        f"{name} of {self.path} is listed in manifest.json but missing"
                    ) from exc
                raise ResumeError(f"cannot read {name} of {self.path}: {exc}") from exc
            if actual != expected[1]:
                raise self._corrupt(name, expected[0], actual, expected[1])

    def exists(self, filename: str) -> bool:
        return self.storage.exists(filename)

    def has(self, filename: str) -> bool:
        """Whether the checkpoint holds ``filename``: listed in the manifest, or (a stock
        transformers checkpoint, which has none) present in the directory."""
        if self.info.manifest:
            return filename in self._digests
        return self.exists(filename)

    def load_optimizer(self) -> dict[str, Any] | None:
        """The optimizer state_dict this runtime saved: one file, or the shards every rank
        wrote of it (shares.py) read back as one state; None when there is none (the
        checkpoint of a ``save_only_model`` run, or of transformers.Trainer). Call
        :meth:`wait_verified` before relying on it."""
        if self.has(OPTIMIZER_NAME):
            return self.load_optimizer_state(OPTIMIZER_NAME)
        if not self.has(OPTIMIZER_INDEX_NAME):
            return None
        index = self.load_json(OPTIMIZER_INDEX_NAME)
        where = f"{self.path}/{OPTIMIZER_INDEX_NAME}"
        meta = index.get(OPTIMIZER_META_KEY) if isinstance(index, dict) else None
        if not isinstance(meta, str):
            raise ResumeError(f"{where} has no {OPTIMIZER_META_KEY}: not an index of ours")
        tensors, _ = load_indexed(
            index, lambda name: self.load_tensors_and_metadata(name, owned=True), where
        )
        return optimizer_state_from_tensors(tensors, meta)

    def load_bytes(self, filename: str) -> bytes:
        """A file's bytes; with ``verify`` its checksum is checked against the manifest."""
        try:
            data = self.storage.read_bytes(filename)
        except StorageError as exc:
            raise ResumeError(f"cannot read {filename} of {self.path}: {exc}") from exc
        expected = self._expected(filename)
        if expected:
            hasher = new_hasher(expected[0])
            hasher.update(data)
            actual = hasher.hexdigest()
            if actual != expected[1]:
                raise self._corrupt(filename, expected[0], actual, expected[1])
        return data

    def _corrupt(
        self, filename: str, algorithm: str, actual: str, expected: str
    ) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"{filename} of {self.path} is corrupt: {algorithm} {actual} != {expected} "
            "(listed in manifest.json); resume from an earlier checkpoint"
        )

    def load_tensors(self, filename: str) -> dict[str, torch.Tensor]:
        """A (small) safetensors file's tensors, read whole and checked before returning."""
        return dict(_st_load(self.load_bytes(filename)))

    def load_metadata(self, filename: str) -> dict[str, str]:
        """The ``__metadata__`` of a safetensors file (its header only is read)."""
        try:
            with self.storage.open_read(filename) as fh:
                header, _ = read_header(fh)
        except (StorageError, OSError, ValueError, CheckpointError) as exc:
            raise ResumeError(f"cannot read {filename} of {self.path}: {exc}") from exc
        return dict(header.get("__metadata__") or {})

    def load_json(self, filename: str) -> Any:
        try:
            return json.loads(self.load_bytes(filename))
        except ValueError as exc:
            raise ResumeError(f"{filename} of {self.path} is not valid JSON: {exc}") from exc

    def load_optimizer_state(self, filename: str) -> dict[str, Any]:
        """The optimizer state_dict written by :meth:`CheckpointWriter.write_optimizer_state`.

        Its tensors are views of one host buffer the file was read into (no further copy when
        ``optimizer.load_state_dict`` keeps them, as torch does for tensors already of the
        parameters' dtype and device); the checksum is computed beside the reading: call
        :meth:`wait_verified` before relying on the state."""
        tensors, metadata = self.load_tensors_and_metadata(filename, owned=True)
        meta = metadata.get(OPTIMIZER_META_KEY)
        if meta is None:
            raise ResumeError(f"{filename} of {self.path} has no {OPTIMIZER_META_KEY} metadata")
        return optimizer_state_from_tensors(tensors, meta)


def verify_checkpoint(path: str, storage_options: dict[str, Any] | None = None) -> None:
    """Check the checkpoint ``path`` against its manifest now, every byte
    (:meth:`CheckpointReader.verify_all`): CheckpointCorruptError when it no longer passes the
    completeness rule or a file does not match; ResumeError when storage cannot be read."""
    storage = Storage(path, storage_options)
    try:
        info = inspect_checkpoint(storage, "")
    except StorageError as exc:
        raise ResumeError(f"cannot inspect {path}: {exc}") from exc
    if not info.complete:
        raise CheckpointCorruptError(
            f"{path} no longer passes the completeness rule: {info.reason}"
        )
    CheckpointReader(path, storage_options).verify_all()


def download_checkpoint(
    path: str, local_dir: str, storage_options: dict[str, Any] | None = None
) -> list[str]:
    """Copy the complete checkpoint ``path`` (e.g. on an object store) to the local directory
    ``local_dir`` for a library that reads local files only (transformers' resume). Files are
    fetched with parallel ranged reads straight into the local file, each checked against the
    manifest's checksum (or size) as it arrives; a mismatch raises ResumeError and the partial
    copy is removed. Returns the names copied (every file the manifest lists, or every file of
    a stock transformers checkpoint)."""
    import mmap
    import shutil

    reader = CheckpointReader(path, storage_options)
    storage = reader.storage
    listed = (reader.info.manifest or {}).get("files")
    sizes = (
        {e["path"]: int(e["size"]) for e in listed}
        if isinstance(listed, list)
        else dict(storage.walk_files(""))
    )
    os.makedirs(local_dir, exist_ok=True)
    try:
        for name, size in sorted(sizes.items()):
            target = os.path.join(local_dir, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            expected = reader._expected(name)
            hasher = new_hasher(expected[0]) if expected else None
            with open(target, "wb+") as fh:
                fh.truncate(size)
                if size:
                    with mmap.mmap(fh.fileno(), size) as view:
                        storage.read_into(name, memoryview(view), hasher.update if hasher else None)
            if hasher is not None and expected is not None and hasher.hexdigest() != expected[1]:
                raise reader._corrupt(name, expected[0], hasher.hexdigest(), expected[1])
    except StorageError as exc:
        shutil.rmtree(local_dir, ignore_errors=True)
        raise ResumeError(f"cannot download {path} to {local_dir}: {exc}") from exc
    except BaseException:
        shutil.rmtree(local_dir, ignore_errors=True)
        raise
    return sorted(sizes)


def write_entry(storage: Storage, rel: str, data: bytes | TensorFile) -> tuple[int, str]:
    """Write bytes, or a safetensors file as it is serialised, durably to ``storage``; returns
    (size, checksum)."""
    if not isinstance(data, TensorFile):
        return storage.write_bytes(rel, data)
    with storage.open_write(rel) as fh:
        write_safetensors(fh.write, data.tensors, data.metadata)
    return fh.size, fh.digest


def warm_local_writes(uri: str) -> threading.Thread | None:
    """Ahead of the first save to ``uri``: allocate and touch, on a background thread, the
    staging blocks that local checkpoint files are written through (enough for the large files
    written at once), so that the save, often a JIT one racing its grace period, does not pay
    for fresh memory (measured here: the two large files of a 20M-parameter checkpoint took
    225 ms from cold blocks, 166 ms from warm ones). Returns the thread; None where writes do
    not stage: ``O_DIRECT`` not asked for (the default: ``checkpoint_direct_io``,
    ``$PREEMPTIBLE_DIRECT_IO``), remote storage, a FUSE mount, no ``O_DIRECT``."""
    if not Storage(uri).writes_direct:
        return None
    thread = threading.Thread(
        target=staging_pool.warm,
        args=(_PARALLEL_FILES * DEPTH,),
        name="ckpt-staging-warm",
        daemon=True,
    )
    thread.start()
    return thread


def _digest_of_file(path: str, algorithm: str) -> str:
    with open(path, "rb", buffering=0) as fh:
        return hash_stream(fh, algorithm)[1]


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__") or {})


# -- optimizer state <-> safetensors ------------------------------------------------------------
def _encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors[key] = value.detach().contiguous()
        return {"__tensor__": key}
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: _encode(v, f"{key}.{k}", tensors) for k, v in value.items()}
        # non-string keys (parameter ids) keep their type
        return {
            "__items__": [
                [_encode(k, f"{key}.k{i}", tensors), _encode(v, f"{key}.{k}", tensors)]
                for i, (k, v) in enumerate(value.items())
            ]
        }
    raise CheckpointError(
        f"optimizer state value at {key!r} has type {type(value).__name__}, which cannot be "
        "stored; "
        "use tensors, numbers, strings, None, lists, tuples or dicts"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            return tensors[value["__tensor__"]]
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        if set(value) == {"__items__"}:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__items__"]}
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value


def optimizer_state_to_tensors(
    state_dict: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], str]:
    """Split a torch optimizer state_dict into tensors (for safetensors) and a JSON string.

    The JSON keeps the structure (``state`` keyed by int parameter ids, ``param_groups`` with
    tuples such as ``betas``) so :func:`optimizer_state_from_tensors` rebuilds it exactly.
    """
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(dict(state_dict), "optimizer", tensors)
    # key order is part of the round trip (param_groups, state dicts): do not sort
    meta = json.dumps({"format": _OPTIMIZER_META_FORMAT, "state_dict": encoded})
    return tensors, meta


def optimizer_state_from_tensors(tensors: Mapping[str, torch.Tensor], meta: str) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_to_tensors`."""
    try:
        doc = json.loads(meta)
    except ValueError as exc:
        raise ResumeError(f"optimizer metadata is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != _OPTIMIZER_META_FORMAT:
        raise ResumeError(
            f"optimizer metadata format {doc.get('format') if isinstance(doc, dict) else doc!r} "
            f"is not {_OPTIMIZER_META_FORMAT!r}"
        )
    try:
        return _decode(doc["state_dict"], tensors)
    except KeyError as exc:
        raise ResumeError(f"optimizer tensor {exc} is missing from the safetensors file") from exc


# -- rotation ---------------------------------------------------------------------------------
# Removed first, while the sentinel is in place: without them no rule calls the rest complete.
_COMMIT_FILES = (MANIFEST_NAME, TRAINER_STATE_NAME)


def remove_checkpoint(
    storage: Storage, name: str, attempt: int | None = None, *, sentinel_present: bool = False
) -> None:
    """Delete the checkpoint directory ``name`` of ``storage`` so that no moment of the deletion
    (a crash, a SIGKILL, a node lost half-way) leaves a directory that passes the completeness
    rule: the sentinel is written first (fsynced); then ``manifest.json`` and
    ``trainer_state.json`` go (what a complete checkpoint, ours or a stock transformers one, is
    recognised by); then the data; the sentinel last; then the directory. A recursive delete
    unlinks in directory order, which could take the sentinel before the data. ``attempt``:
    the attempt the sentinel names (the one that wrote the checkpoint). ``sentinel_present``:
    the caller knows the sentinel is there (its own, e.g. on a full disk where nothing more can
    be written): it is not written again."""
    sentinel = f"{name}/{SENTINEL_NAME}"
    if not sentinel_present:
        storage.write_json(sentinel, {"removing": True, "attempt": attempt})
        storage.fsync_dir(name)
    for rel in _COMMIT_FILES:
        try:
            storage.remove(f"{name}/{rel}")
        except StorageError as exc:
            if not exc.not_found:
                raise
    storage.fsync_dir(name)
    if not storage.is_object_store:
        # Object stores: one batch delete below (the manifest is already gone); elsewhere the
        # files one by one, so that the sentinel is the last.
        for rel in sorted(storage.walk_files(name)):
            if rel != SENTINEL_NAME:
                storage.remove(f"{name}/{rel}")
        storage.fsync_dir(name)
        storage.remove(sentinel)
    storage.rm_tree(name)


def rotate_checkpoints(
    output_dir: str,
    save_total_limit: int | None,
    protect: Iterable[str] = (),
    storage_options: dict[str, Any] | None = None,
    *,
    attempt: int | None = None,
) -> list[str]:
    """Remove the checkpoints :func:`rotation_victims` selects; returns the removed paths.

    Call it only after the new checkpoint is committed. Refuses (CheckpointError) when a checkpoint
    of an attempt newer than ``attempt`` (default $PREEMPTIBLE_ATTEMPT) exists. Incomplete
    directories of an older attempt are removed even when newer than the newest complete
    checkpoint (no live writer can be writing them). Each victim is removed by
    :func:`remove_checkpoint`: a removal interrupted half-way never leaves a complete-looking
    checkpoint.

    On object stores the checkpoints come from one recursive listing, without reading each one's
    manifest (layout.infos_from_listing: complete means manifest present, sentinel absent), and
    the fence from the registered attempts (layout.fence_attempts): its requests do not grow with
    the number of checkpoints. Pass the checkpoint just committed in ``protect``.
    """
    store = CheckpointStore(output_dir, storage_options)
    local = not store.storage.is_object_store
    # Object stores: one recursive listing, no manifest read per checkpoint (this runs after
    # every save, the JIT one included); the fence from the registered attempts.
    checkpoints = store.list() if local else store.list_from_listing()
    mine = attempt_from_env(attempt)
    victims = rotation_victims(checkpoints, save_total_limit, frozenset(protect), mine)
    if not victims:
        return []
    if local:
        fence_check(checkpoints, mine, "rotate checkpoints")
    else:
        fence_attempts(store.storage, mine, "rotate checkpoints")
    removed: list[str] = []
    for victim in victims:
        remove_checkpoint(store.storage, victim.name, victim.attempt)
        removed.append(victim.path)
    store.storage.fsync_dir("")
    return removed
