"""One small facade over fsspec: the only module of the runtime that touches a filesystem.

Paths given to the methods are relative to the URL the :class:`Storage` was opened on. Local and
mounted filesystems (a PVC is one) get real durability: every file written through
:meth:`Storage.open_write` is flushed and fsynced before it counts as written, and
:meth:`Storage.atomic_write_json` writes a temporary file and renames it over the target, then
fsyncs the directory. Object stores (s3, gcs, ...) make an object durable and visible in one piece
when its upload completes, so there the final name is written directly: streamed as a multipart
upload that is aborted on any error (nothing partial is published), conditionally
(``If-None-Match``) where the caller asks for ``exclusive`` (the manifest); reads of large files
are parallel ranged reads (:mod:`object_store`).

Every backend error becomes a :class:`~trainer_runtime.errors.StorageError` naming the URL, the
operation and the cause. This module is torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any, BinaryIO

import fsspec
from fsspec.asyn import AsyncFileSystem
from fsspec.implementations.local import LocalFileSystem

from trainer_runtime.checkpoint import object_store, read_stats
from trainer_runtime.checkpoint.digest import hash_stream, new_hasher
from trainer_runtime.checkpoint.direct_io import DirectFile, direct_io_supported, usable_at
from trainer_runtime.errors import StorageError

__all__ = ["ENV_DIRECT_IO", "HashingWriter", "Storage", "configure_direct_io", "direct_io_wanted"]

logger = logging.getLogger(__name__)

# Overrides TrainingArguments.checkpoint_direct_io when set: 1 (true/yes/on) or 0 (false/no/off).
ENV_DIRECT_IO = "PREEMPTIBLE_DIRECT_IO"


# Blocks at least this large are hashed on a helper thread while the next one is written.
_PIPELINE_MIN = 1 << 20
# Local files: ask the kernel to start writing back every this many bytes, so the final fsync
# waits for the tail only (writeback overlaps the serialisation instead of following it).
_WRITEBACK_EVERY = 128 << 20


class HashingWriter:
    """A write-only file handle that counts bytes and computes the checksum (:mod:`digest`) while
    writing.

    Checksums are computed from the bytes as they go out, never by reading the file back. Large
    blocks are hashed on a helper thread while the next block is written (the hash and
    file writes release the GIL); the caller must not modify a block it passed until the next
    ``write`` or the end of the file (tensors of a checkpoint are not modified while saved).
    On local files, writeback to disk is started every 128 MiB (``fdatasync`` on a helper
    thread), so the fsync at the end of the file only waits for the tail.
    """

    def __init__(self, handle: BinaryIO, storage: Storage, rel: str) -> None:
        self._handle = handle
        self._storage = storage
        self._rel = rel
        self._hasher = new_hasher()
        self.size = 0
        self._pending: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._flushing: Future[None] | None = None
        self._since_flush = 0
        self._fd: int | None = None
        if storage.is_local:
            with suppress(Exception):
                self._fd = handle.fileno()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        n = len(data)
        if n >= _PIPELINE_MIN:
            self._wait_hash()
            self._pending = self._helpers().submit(self._hasher.update, data)
        else:
            self._wait_hash()
            self._hasher.update(data)
        with self._storage._op("write", self._rel):
            self._handle.write(data)
        self.size += n
        self._since_flush += n
        if self._fd is not None and self._since_flush >= _WRITEBACK_EVERY:
            self._start_writeback()
        return n

    def _helpers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-io")
        return self._pool

    def _wait_hash(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def _start_writeback(self) -> None:
        if self._flushing is not None and not self._flushing.done():
            return  # the previous one still runs: it will be followed by the final fsync
        assert self._fd is not None
        self._handle.flush()
        self._since_flush = 0
        self._flushing = self._helpers().submit(os.fdatasync, self._fd)

    def finish(self) -> None:
        """Wait for the helper threads (hash, writeback); called before the final fsync."""
        try:
            self._wait_hash()
            if self._flushing is not None:
                with self._storage._op("write back", self._rel):
                    self._flushing.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    @property
    def digest(self) -> str:
        self._wait_hash()
        return self._hasher.hexdigest()


class _LocalWriter:
    """A :class:`DirectFile` whose write errors name the storage URL (StorageError)."""

    def __init__(self, file: DirectFile, storage: Storage, rel: str) -> None:
        self.file = file
        self._storage = storage
        self._rel = rel

    def write(self, data: bytes | bytearray | memoryview) -> int:
        with self._storage._op("write", self._rel):
            return self.file.write(data)

    @property
    def size(self) -> int:
        return self.file.size

    @property
    def digest(self) -> str:
        return self.file.digest


class Storage:
    """A directory on any fsspec filesystem: a plain path, ``file://``, ``memory://``, ``s3://``...

    ``storage_options`` are passed to the fsspec filesystem (credentials, endpoints).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise StorageError(
                repr(url), "open filesystem", ValueError("URL must be a non-empty str")
            )
        self.url = url.rstrip("/") or url
        self.storage_options = dict(storage_options or {})
        options = self.storage_options
        if fsspec.core.split_protocol(url)[0] in object_store.S3_PROTOCOLS:
            # bounded retries and timeouts unless the user set them (object_store.s3_options)
            options = object_store.s3_options(options)
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except Exception as exc:
            raise StorageError(url, "open filesystem", exc, hint=_SCHEME_HINT) from exc
        self.fs: fsspec.AbstractFileSystem = fs
        self.root: str = root.rstrip("/") or root
        # Real files with real fsync and rename: local disks and mounted volumes (PVCs, NFS).
        self.is_local = isinstance(fs, LocalFileSystem)
        self.is_s3 = object_store.is_s3(fs)
        # Network object stores (s3, gcs, azure: fsspec's async filesystems), where every
        # request is a round trip: the attempt fence and rotation avoid one per checkpoint.
        self.is_object_store = not self.is_local and isinstance(fs, AsyncFileSystem)
        if self.is_s3:
            # botocore retries each request already (s3_options): s3fs' own loop around it
            # would multiply the attempts (5 x 3) and the time a dead server takes to surface.
            fs.retries = min(int(getattr(fs, "retries", 2)), 2)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # -- paths ---------------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        """The URL (or plain path, when opened on one) of ``parts`` under this storage."""
        tail = "/".join(p.strip("/") for p in parts if p and p.strip("/"))
        if not tail:
            return self.url
        return f"{self.url}/{tail}" if self.url != "/" else f"/{tail}"

    def _path(self, rel: str) -> str:
        rel = rel.strip("/")
        if not rel:
            return self.root
        return f"{self.root}/{rel}" if self.root != "/" else f"/{rel}"

    @property
    def endpoint(self) -> str | None:
        """The object store's endpoint URL (S3), for messages; None elsewhere."""
        return object_store.endpoint_of(self.fs)

    @contextmanager
    def _op(self, operation: str, rel: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            if not self.is_object_store:
                raise StorageError(self.join(rel), operation, exc) from exc
            raise StorageError(
                self.join(rel),
                operation,
                exc,
                hint=object_store.error_hint(exc),
                endpoint=self.endpoint,
            ) from exc

    # -- queries -------------------------------------------------------------------------------
    def _fresh(self, path: str) -> None:
        # Object-store filesystems cache listings; other processes (ranks, the next attempt)
        # change the directory under us, so every query starts uncached.
        with suppress(Exception):
            self.fs.invalidate_cache(path)

    def exists(self, rel: str = "") -> bool:
        path = self._path(rel)
        with self._op("exists", rel):
            self._fresh(path)
            return bool(self.fs.exists(path))

    def isdir(self, rel: str = "") -> bool:
        path = self._path(rel)
        with self._op("isdir", rel):
            self._fresh(path)
            return bool(self.fs.isdir(path))

    def _ls(self, rel: str) -> list[dict[str, Any]]:
        path = self._path(rel)
        with self._op("list", rel):
            self._fresh(path)
            return list(self.fs.ls(path, detail=True))

    def listdir(self, rel: str = "") -> dict[str, int]:
        """Files directly under ``rel``: name -> size in bytes (directories are not included)."""
        out: dict[str, int] = {}
        for entry in self._ls(rel):
            if entry.get("type") == "file":
                out[entry["name"].rstrip("/").rsplit("/", 1)[-1]] = int(entry.get("size") or 0)
        return out

    def subdirs(self, rel: str = "") -> list[str]:
        """Names of the directories directly under ``rel``, sorted."""
        names = []
        base = self._path(rel).rstrip("/")
        for entry in self._ls(rel):
            name = entry["name"].rstrip("/")
            if entry.get("type") == "directory" and name != base:
                names.append(name.rsplit("/", 1)[-1])
        return sorted(names)

    def walk_files(self, rel: str = "") -> dict[str, int]:
        """Every file under ``rel`` at any depth: path relative to ``rel`` -> size in bytes."""
        base = self._path(rel).rstrip("/")
        with self._op("list", rel):
            self._fresh(base)
            found = self.fs.find(base, detail=True)
        out: dict[str, int] = {}
        for name, entry in found.items():
            if entry.get("type", "file") != "file":
                continue
            name = name.rstrip("/")
            relname = name[len(base) + 1 :] if name.startswith(base + "/") else name
            out[relname] = int(entry.get("size") or 0)
        return out

    def read_bytes(self, rel: str) -> bytes:
        path = self._path(rel)
        with self._op("read", rel):
            # s3fs answers a read from a cached listing that lacks the file (a listing taken
            # before another writer, or our own try whose response was lost, created it)
            self._fresh(path)
            data = bytes(self.fs.cat_file(path))
        read_stats.add(len(data))
        return data

    @contextmanager
    def open_read(self, rel: str) -> Iterator[BinaryIO]:
        """A binary read handle (for streaming large files instead of reading them whole); its
        reads are counted (:mod:`read_stats`)."""
        with self._op("open for reading", rel):
            handle: Any = read_stats.CountingHandle(self.fs.open(self._path(rel), "rb"))
        try:
            yield handle
        finally:
            with suppress(Exception):
                handle.close()

    def size(self, rel: str) -> int:
        """A file's size in bytes."""
        with self._op("stat", rel):
            return int(self.fs.size(self._path(rel)))

    def read_into(
        self, rel: str, dest: memoryview, on_block: Callable[[memoryview], Any] | None = None
    ) -> None:
        """Fill ``dest`` with the first ``len(dest)`` bytes of a file; ``on_block`` gets them in
        file order as they arrive (e.g. a checksum, computed beside the reading). Object
        stores: parallel ranged reads (:func:`object_store.read_into`)."""
        self.read_range(rel, 0, dest, on_block)

    def read_range(
        self,
        rel: str,
        offset: int,
        dest: memoryview,
        on_block: Callable[[memoryview], Any] | None = None,
    ) -> None:
        """Fill ``dest`` with the ``len(dest)`` bytes of a file from byte ``offset`` on, straight
        into ``dest`` (local: positional reads; object stores: ranged GETs, in parallel);
        ``on_block`` as for :meth:`read_into`. Counted (:mod:`read_stats`)."""
        view = dest.cast("B") if dest.format != "B" else dest
        if self.is_local:
            with self._op("read", rel), open(self._path(rel), "rb", buffering=0) as fh:
                fd = fh.fileno()
                done = 0
                while done < len(view):
                    n = os.preadv(fd, [view[done : done + (16 << 20)]], offset + done)
                    if not n:
                        raise OSError(f"short read: {done} of {len(view)} bytes at {offset}")
                    read_stats.add(n)
                    if on_block is not None:
                        on_block(view[done : done + n])
                    done += n
            return
        with self._op("read", rel):
            object_store.read_into(self.fs, self._path(rel), view, on_block, offset=offset)
        read_stats.add(len(view))

    def check_access(self, *, write: bool) -> None:
        """Before training: the output dir's store answers with these credentials and its
        bucket exists (object stores), and with ``write`` a file can be created there (a probe
        object written and removed). Raises StorageError naming the URL, the endpoint and the
        cause. Local directories are created when first written; nothing is checked here.
        Other filesystems with directories (fsspec's NFS/SFTP kinds) get the directory created
        first, as a local run would, so the probe tests the permission and not the order."""
        if self.is_local:
            return
        with self._op("check access (before training)", ""):
            if write and not self.is_object_store:
                self.fs.makedirs(self.root, exist_ok=True)
            object_store.check_access(self.fs, self.root, write=write)

    def read_json(self, rel: str) -> Any:
        data = self.read_bytes(rel)
        try:
            return json.loads(data)
        except ValueError as exc:
            raise StorageError(self.join(rel), "parse JSON", exc) from exc

    # -- writes --------------------------------------------------------------------------------
    def makedirs(self, rel: str = "") -> None:
        if self.is_s3:
            # S3 has no directories; and s3fs' makedirs creates a missing bucket, which must
            # fail the run instead (check_access)
            return
        with self._op("create directory", rel):
            self.fs.makedirs(self._path(rel), exist_ok=True)

    @property
    def writes_direct(self) -> bool:
        """Whether :meth:`open_write` writes around the page cache (local, ``O_DIRECT``): only
        where asked for (:func:`direct_io_wanted`), and not on FUSE mounts or a filesystem that
        refused it (:func:`direct_io.usable_at`)."""
        return self.is_local and direct_io_wanted() and usable_at(self.root)

    @contextmanager
    def open_write(
        self, rel: str, *, exclusive: bool = False
    ) -> Iterator[HashingWriter | _LocalWriter]:
        """Write a file; on a clean exit it is flushed and fsynced (local) or uploaded (remote).

        Local files go through the page cache, or around it (:mod:`direct_io`) where
        :attr:`writes_direct`; the handle's ``size`` and ``digest`` describe what was written.
        Object stores: streamed as a multipart upload, published only on a clean exit and
        aborted otherwise; ``exclusive`` publishes only if the object does not exist
        (``If-None-Match: *``; StorageError whose cause is FileExistsError otherwise). Local
        files ignore ``exclusive`` (the manifest is renamed into place there)."""
        path = self._path(rel)
        if not self.is_local:
            with self._op("open for writing", rel):
                upload = object_store.open_upload(self.fs, path, exclusive=exclusive)
            writer = HashingWriter(upload, self, rel)  # type: ignore[arg-type]
            try:
                yield writer
                writer.finish()
            except BaseException:
                with suppress(Exception):
                    writer.finish()
                with suppress(Exception):
                    upload.abort()  # nothing is published
                raise
            try:
                with self._op("upload", rel):
                    upload.close()
            except BaseException:
                with suppress(Exception):
                    upload.abort()
                raise
            return
        if self.writes_direct:
            with self._op("open for writing", rel):
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                direct = _LocalWriter(DirectFile(path), self, rel)
            try:
                yield direct
                with self._op("write", rel):
                    direct.file.flush()  # the last block, and the blocks still in flight
            except BaseException:
                with suppress(Exception):
                    direct.file.abort()
                raise
            with self._op("flush and fsync", rel):
                direct.file.close()
            return
        with self._op("open for writing", rel):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            handle: Any = open(path, "wb")  # noqa: SIM115 - closed below
        writer = HashingWriter(handle, self, rel)
        try:
            yield writer
            writer.finish()
        except BaseException:
            with suppress(Exception):
                writer.finish()
            with suppress(Exception):
                handle.close()
            raise
        with self._op("flush and fsync", rel):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()

    def write_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> tuple[int, str]:
        """Write ``data`` durably; returns (size, digest). ``exclusive``: see :meth:`open_write`."""
        with self.open_write(rel, exclusive=exclusive) as fh:
            fh.write(data)
        return fh.size, fh.digest

    def write_json(self, rel: str, obj: Any) -> tuple[int, str]:
        return self.write_bytes(rel, _json_bytes(obj))

    def atomic_write_json(self, rel: str, obj: Any, *, exclusive: bool = False) -> tuple[int, str]:
        """Write JSON so that readers see either nothing/the old content or all of the new.

        Local: temp file, fsync, rename over the target, fsync the directory. Object stores: one
        upload of the final name (an object becomes visible only once complete); with
        ``exclusive`` a conditional one that fails if the object exists (the commit point: of
        two writers, exactly one publishes).
        """
        return self.atomic_write_bytes(rel, _json_bytes(obj), exclusive=exclusive)

    def atomic_write_bytes(
        self, rel: str, data: bytes, *, exclusive: bool = False
    ) -> tuple[int, str]:
        """:meth:`atomic_write_json` for any bytes."""
        if not self.is_local:
            return self.write_bytes(rel, data, exclusive=exclusive)
        head, _, name = rel.strip("/").rpartition("/")
        tmp_name = f".{name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp_rel = f"{head}/{tmp_name}" if head else tmp_name
        try:
            result = self.write_bytes(tmp_rel, data)
            with self._op("rename into place", rel):
                os.replace(self._path(tmp_rel), self._path(rel))
        except BaseException as exc:
            with suppress(Exception):
                os.unlink(self._path(tmp_rel))
            if isinstance(exc, StorageError) and exc.url != self.join(rel):
                # report the file the caller asked for, not our temporary name
                raise StorageError(
                    self.join(rel), f"atomic write ({exc.operation} of {tmp_name})", exc.cause
                ) from exc.cause
            raise
        self.fsync_dir(head)
        return result

    def remove(self, rel: str) -> None:
        with self._op("remove", rel):
            self.fs.rm_file(self._path(rel))

    def rm_tree(self, rel: str) -> None:
        with self._op("remove tree", rel):
            self.fs.rm(self._path(rel), recursive=True)

    def fsync_file(self, rel: str) -> None:
        """Flush a file another writer (e.g. transformers' own save) left in the page cache to
        disk; no-op off local disks (an uploaded object is already durable)."""
        if not self.is_local:
            return
        with self._op("fsync", rel):
            fd = os.open(self._path(rel), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def hash_file(self, rel: str, chunk: int = 1 << 22) -> tuple[int, str]:
        """(size, digest) of an existing file, read in chunks (weights can be large)."""
        with self._op("read for checksum", rel), self.fs.open(self._path(rel), "rb") as fh:
            return hash_stream(read_stats.CountingHandle(fh), chunk=chunk)

    def fsync_dir(self, rel: str = "") -> None:
        """Make directory entries (new, renamed, removed files) durable; no-op off local disks."""
        if not self.is_local:
            return
        with self._op("fsync directory", rel):
            fd = os.open(self._path(rel), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


_SCHEME_HINT = (
    "use a local path, file://, or an fsspec URL whose filesystem is installed: s3:// needs "
    "pip install 'preemptible[s3]' (s3fs), gs:// gcsfs, az:// adlfs"
)


_direct_io_asked = False  # TrainingArguments.checkpoint_direct_io of the last Trainer
_direct_io_announced = False
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off", "")


def configure_direct_io(enabled: bool) -> None:
    """Ask for ``O_DIRECT`` checkpoint writes in this process (the Trainer passes
    ``TrainingArguments.checkpoint_direct_io``); ``$PREEMPTIBLE_DIRECT_IO`` overrides it."""
    global _direct_io_asked
    _direct_io_asked = bool(enabled)


def direct_io_wanted() -> bool:
    """Whether local checkpoint files are to be written with ``O_DIRECT``: off unless asked for,
    by ``$PREEMPTIBLE_DIRECT_IO`` (1 or 0, wins when set) or else :func:`configure_direct_io`.
    Logs once, at INFO, the first time it is on."""
    global _direct_io_announced
    env = os.environ.get(ENV_DIRECT_IO)
    if env is not None and env.strip().lower() in _ON + _OFF:
        wanted = env.strip().lower() in _ON
        source = f"${ENV_DIRECT_IO}={env.strip()}"
    else:
        wanted = _direct_io_asked
        source = "TrainingArguments.checkpoint_direct_io"
    if not (wanted and direct_io_supported()):
        return False
    if not _direct_io_announced:
        _direct_io_announced = True
        logger.info(
            "checkpoint_direct_io is on (%s): local checkpoint files are written with O_DIRECT "
            "through aligned 4 MiB staging blocks (kept for the process), around the page "
            "cache. It was measured faster only on a VM where first touching page-cache memory "
            "is slow; a resume on this machine then reads the checkpoint from disk. FUSE mounts "
            "and filesystems that refuse it get buffered, in-order writes.",
            source,
        )
    return True


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
