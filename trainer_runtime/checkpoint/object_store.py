"""Object stores behind :class:`~trainer_runtime.checkpoint.storage.Storage` (torch-free).

What a checkpoint needs from an object store, and how it gets it:

- **Nothing partial is ever published.** A file is streamed as an S3 multipart upload: parts go
  up on the filesystem's event loop while the next part is being filled (``concurrency`` parts
  in flight, so host memory per file is bounded by ``(concurrency + 1) * part size``), and the
  object appears only at CompleteMultipartUpload. On any error the upload is aborted
  (AbortMultipartUpload): the key is left as it was. fsspec's own file handle would publish
  what it buffered on ``close()`` (its close flushes), which is why uploads do not go through it.
  Other fsspec object stores (gcs, az, memory) go through their file handle with ``discard()``
  on an error.
- **Conditional creates.** ``exclusive=True`` sends ``If-None-Match: *`` on the PutObject or the
  CompleteMultipartUpload: a second writer of the same key gets FileExistsError, and the store
  decides atomically. Where the store does not implement the header (HTTP 501), the write falls
  back to check-then-write once, with a warning.
- **Parallel ranged reads** (:func:`read_into`): a file is fetched as ranges, ``concurrency`` at a
  time, straight into the caller's buffer; ``on_block`` sees the bytes in file order as soon as a
  contiguous prefix has arrived (the checksum runs beside the download).
- **Checks before training** (:func:`check_access`): the bucket exists, the credentials work, and
  (for the writer) an object can be created and removed there.

Defaults of the S3 client (:func:`s3_options`) bound how long a dead server or a cut network takes
to surface as an error: three attempts (botocore's "standard" retry mode), 5 s to connect, 15 s
to read and 20 s for sent data to be acknowledged (TCP_USER_TIMEOUT), unless the user's storage
options or ``$AWS_MAX_ATTEMPTS`` / ``$AWS_RETRY_MODE`` say otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import importlib.metadata
import logging
import os
import re
import socket
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync

__all__ = [
    "FsspecUpload",
    "S3Upload",
    "accepts_socket_factory",
    "check_access",
    "endpoint_of",
    "error_hint",
    "is_s3",
    "open_upload",
    "part_size",
    "read_into",
    "read_ranges",
    "s3_options",
    "tcp_socket",
]

logger = logging.getLogger(__name__)

S3_PROTOCOLS = frozenset({"s3", "s3a"})
# The first parts are this large; S3 allows 10,000 parts per upload, so part_size() grows them.
PART_BYTES = int(os.environ.get("PREEMPTIBLE_S3_PART_MB", "16")) << 20
# Parts of one file in flight at once (uploads), and ranges of one file (downloads).
CONCURRENCY = max(1, int(os.environ.get("PREEMPTIBLE_S3_CONCURRENCY", "4")))
READ_CHUNK = int(os.environ.get("PREEMPTIBLE_S3_READ_CHUNK_MB", "16")) << 20
READ_CONCURRENCY = max(1, int(os.environ.get("PREEMPTIBLE_S3_READ_CONCURRENCY", "8")))
_MIN_PART = 5 << 20  # S3's minimum for every part but the last
_MAX_PARTS = 10_000
_PARTS_PER_DOUBLING = 2_000
# Where the write probe of check_access() goes (removed at once).
PROBE_PREFIX = ".preemptible-probe-"

_warned_unconditional: set[str] = set()


def is_s3(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    return bool(S3_PROTOCOLS.intersection(protocols))


def accepts_socket_factory(aiobotocore_version: str) -> bool:
    """Whether aiobotocore of this version takes ``connector_args={"socket_factory": ...}``
    (from 3.1.0; earlier versions refuse unknown connector arguments); pure."""
    parts = re.findall(r"\d+", aiobotocore_version)[:3]
    numbers = tuple(int(p) for p in parts) + (0,) * (3 - len(parts))
    return numbers >= (3, 1, 0)


@functools.cache
def _socket_factory_supported() -> bool:
    try:
        return accepts_socket_factory(importlib.metadata.version("aiobotocore"))
    except importlib.metadata.PackageNotFoundError:
        return False


def s3_options(
    options: dict[str, Any],
    environ: dict[str, str] | None = None,
    *,
    socket_factory: bool | None = None,
) -> dict[str, Any]:
    """``options`` for an S3 filesystem with our retry and timeout defaults added where neither
    they nor the environment set them; pure.

    Three attempts in botocore's standard mode (exponential backoff), 5 s to connect, 15 s per
    read: a dead server surfaces in seconds and a cut network in well under a minute, instead of
    the minutes that s3fs' and botocore's retries stacked on each other can take."""
    env = os.environ if environ is None else environ
    out = dict(options)
    config = dict(out.get("config_kwargs") or {})
    if "retries" not in config and not (env.get("AWS_MAX_ATTEMPTS") or env.get("AWS_RETRY_MODE")):
        config["retries"] = {"max_attempts": 3, "mode": "standard"}
    config.setdefault("connect_timeout", 5)
    config.setdefault("read_timeout", 15)
    # The read timeout does not cover sending: a part of an upload whose network is cut waits
    # for TCP to give up (about 15 minutes on Linux). TCP_USER_TIMEOUT ends it after 20 s
    # without an acknowledgement (where aiobotocore lets us set it: ``socket_factory``).
    if socket_factory is None:
        socket_factory = _socket_factory_supported()
    if socket_factory:
        config.setdefault("connector_args", {"socket_factory": tcp_socket})
    out["config_kwargs"] = config
    return out


# Seconds sent data may stay unacknowledged before the connection fails (TCP_USER_TIMEOUT).
TCP_USER_TIMEOUT = float(os.environ.get("PREEMPTIBLE_S3_TCP_USER_TIMEOUT", "20"))


def tcp_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """The sockets of the S3 client: keepalive, and TCP_USER_TIMEOUT where the OS has it."""
    family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
    sock = socket.socket(family=family, type=kind, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if hasattr(socket, "TCP_USER_TIMEOUT") and family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(TCP_USER_TIMEOUT * 1000))
    return sock


def endpoint_of(fs: fsspec.AbstractFileSystem) -> str | None:
    """The endpoint URL an S3 filesystem talks to (for error messages); None off S3."""
    if not is_s3(fs):
        return None
    client = getattr(fs, "_s3", None)
    url = getattr(getattr(client, "meta", None), "endpoint_url", None)
    if url:
        return str(url)
    kwargs = getattr(fs, "client_kwargs", None) or {}
    url = getattr(fs, "endpoint_url", None) or kwargs.get("endpoint_url")
    url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return str(url) if url else "the AWS S3 endpoint of the region"


def part_size(index: int, base: int) -> int:
    """Size of part ``index`` (1-based) of a streamed upload whose total size is not known in
    advance; pure. Parts double every 2,000, so 10,000 parts reach about 1 TB from 16 MiB ones
    (S3's limits: at least 5 MiB per part but the last, at most 10,000 parts)."""
    if index < 1:
        raise ValueError(f"part index {index} must be >= 1")
    base = max(base, _MIN_PART)
    return base << ((index - 1) // _PARTS_PER_DOUBLING)


def read_ranges(size: int, chunk: int = READ_CHUNK) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``size`` bytes in order, each at most ``chunk``; pure."""
    if size < 0 or chunk < 1:
        raise ValueError(f"size={size}, chunk={chunk}: need size >= 0 and chunk >= 1")
    return [(start, min(start + chunk, size)) for start in range(0, size, chunk)]


def error_hint(exc: BaseException) -> str | None:
    """What the user can do about an object store's error; pure (by the exception's type and
    the store's error code, as s3fs and botocore report them)."""
    name = type(exc).__name__
    text = str(exc)
    if (
        name in ("NoCredentialsError", "PartialCredentialsError")
        or "Unable to locate credentials" in text
    ):
        return (
            "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (under the operator: "
            "spec.checkpoint.credentialsSecret, or envFrom a Secret)"
        )
    if any(code in text for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch")):
        return "the credentials are wrong: check the access key and the secret key"
    if "NoSuchBucket" in text or re.search(r"bucket .*does not exist", text.lower()):
        return "the bucket does not exist: create it, or fix the bucket in the URL"
    if isinstance(exc, PermissionError) or "AccessDenied" in text:
        return "access denied: the credentials may not read or write this bucket or prefix"
    if isinstance(exc, FileExistsError):
        return "the object exists already: another writer published it first"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        return "the endpoint cannot be reached: check AWS_ENDPOINT_URL and the network"
    if "InsufficientStorage" in text or "No space left" in text or "QuotaExceeded" in text:
        return "the bucket or the server's storage is full: free space or raise the quota"
    if getattr(exc, "errno", None) == getattr(errno, "EREMOTEIO", 121) or "InternalError" in text:
        return (
            "the server failed to store or serve the object (HTTP 500): a full or read-only "
            "bucket does this; see the server's logs"
        )
    if name in ("ReadTimeoutError",) or isinstance(exc, TimeoutError):
        return "the store stopped answering (timeout): check the server and the network"
    return None


# -- uploads ------------------------------------------------------------------------------------
class S3Upload:
    """One object written as it is produced: a single PutObject when it fits one part, else a
    multipart upload with parts in flight while the next one fills. ``close()`` publishes it
    (conditionally with ``exclusive``); ``abort()`` leaves nothing."""

    def __init__(
        self,
        fs: Any,
        path: str,
        *,
        exclusive: bool = False,
        base_part: int | None = None,
        concurrency: int | None = None,
    ) -> None:
        self._fs = fs
        self._path = path
        self._bucket, self._key, _ = fs.split_path(path)
        self._exclusive = exclusive
        self._base = base_part or PART_BYTES
        self._concurrency = max(1, concurrency or CONCURRENCY)
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._inflight: deque[tuple[int, Future[Any]]] = deque()
        self._etags: dict[int, str] = {}
        self._next_part = 1
        self._done = False

    # file-like, for HashingWriter
    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        while view:
            room = part_size(self._next_part, self._base) - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) >= part_size(self._next_part, self._base):
                self._send_part()
        return n

    def flush(self) -> None:
        """Parts go up as they fill; nothing to do (HashingWriter calls it on local files only)."""

    def _call(self, method: str, **kwargs: Any) -> Any:
        return sync(self._fs.loop, self._fs._call_s3, method, Bucket=self._bucket, **kwargs)

    def _send_part(self) -> None:
        if self._upload_id is None:
            mpu = self._call("create_multipart_upload", Key=self._key)
            self._upload_id = mpu["UploadId"]
        while len(self._inflight) >= self._concurrency:
            self._collect_oldest()
        number, body = self._next_part, bytes(self._buffer)
        self._buffer = bytearray()
        self._next_part += 1
        coro = self._fs._call_s3(
            "upload_part",
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=body,
        )
        self._inflight.append((number, asyncio.run_coroutine_threadsafe(coro, self._fs.loop)))

    def _collect_oldest(self) -> None:
        number, future = self._inflight.popleft()
        self._etags[number] = future.result()["ETag"]

    def close(self) -> None:
        """Publish the object (raises FileExistsError with ``exclusive`` if it exists)."""
        if self._done:
            return
        if self._upload_id is None:
            self._conditional("put_object", Key=self._key, Body=bytes(self._buffer))
        else:
            if self._buffer or self._next_part == 1:
                self._send_part()
            while self._inflight:
                self._collect_oldest()
            parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(self._etags.items())]
            self._conditional(
                "complete_multipart_upload",
                Key=self._key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": parts},
            )
        self._done = True
        self._buffer = bytearray()
        self._fs.invalidate_cache(self._path)

    def _conditional(self, method: str, **kwargs: Any) -> None:
        if not self._exclusive:
            self._call(method, **kwargs)
            return
        try:
            self._call(method, IfNoneMatch="*", **kwargs)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:  # 501 NotImplemented: the store ignores conditions
                raise
            endpoint = endpoint_of(self._fs) or "?"
            if endpoint not in _warned_unconditional:
                _warned_unconditional.add(endpoint)
                logger.warning(
                    "%s does not implement conditional writes (If-None-Match): checking that "
                    "%s does not exist before writing it instead",
                    endpoint,
                    self._path,
                )
            self._fs.invalidate_cache(self._path)
            if self._fs.exists(self._path):
                raise FileExistsError(errno.EEXIST, "the object exists", self._path) from exc
            self._call(method, **kwargs)

    def abort(self) -> None:
        """Drop everything: the parts in flight, the multipart upload (nothing is published)."""
        if self._done:
            return
        self._done = True
        self._buffer = bytearray()
        for _, future in self._inflight:
            future.cancel()
        for _, future in self._inflight:
            # cancelled or failed: the upload is dropped either way
            with contextlib.suppress(BaseException):
                future.result(timeout=30)
        self._inflight.clear()
        if self._upload_id is not None:
            try:
                self._call("abort_multipart_upload", Key=self._key, UploadId=self._upload_id)
            except Exception as exc:
                # Unreachable store: the parts stay invisible until a lifecycle rule
                # (AbortIncompleteMultipartUpload) removes them; no object was published.
                logger.warning(
                    "could not abort the multipart upload of %s (%s): its parts stay invisible "
                    "until the bucket's AbortIncompleteMultipartUpload rule removes them",
                    self._path,
                    exc,
                )


class FsspecUpload:
    """Any other fsspec object store: its own file handle, ``discard()`` instead of ``close()``
    on an error (a close would publish what was buffered)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, exclusive: bool = False):
        self._fs = fs
        self._path = path
        if exclusive:
            fs.invalidate_cache(path)
            if fs.exists(path):
                raise FileExistsError(errno.EEXIST, "the object exists", path)
        self._handle = fs.open(path, "wb")

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._handle.write(data)

    def flush(self) -> None:
        """Nothing: the handle uploads as it fills."""

    def close(self) -> None:
        self._handle.close()

    def abort(self) -> None:
        handle = self._handle
        try:
            handle.discard()
        except RuntimeError:
            # a handle that writes in place and cannot discard (a local file behind another
            # protocol): what it wrote is there already, as on a disk; close it
            handle.close()
            return
        # close() would still flush what is buffered: mark the handle closed instead (an
        # in-memory file has no such flag, and nothing to flush)
        with contextlib.suppress(AttributeError):
            handle.closed = True
        from fsspec.implementations.memory import MemoryFileSystem

        if isinstance(self._fs, MemoryFileSystem):
            # the in-memory store publishes a file when it is opened: remove what was written
            self._fs.store.pop(self._fs._strip_protocol(self._path), None)


def open_upload(
    fs: fsspec.AbstractFileSystem, path: str, *, exclusive: bool = False
) -> S3Upload | FsspecUpload:
    if is_s3(fs):
        return S3Upload(fs, path, exclusive=exclusive)
    return FsspecUpload(fs, path, exclusive=exclusive)


# -- reads --------------------------------------------------------------------------------------
def read_into(
    fs: fsspec.AbstractFileSystem,
    path: str,
    dest: memoryview,
    on_block: Callable[[memoryview], Any] | None = None,
    *,
    chunk: int | None = None,
    concurrency: int | None = None,
    offset: int = 0,
) -> None:
    """Fill ``dest`` with ``len(dest)`` bytes of ``path`` from byte ``offset`` on: ranged reads,
    ``concurrency`` at a time on an async filesystem (s3, gcs, ...), one after another otherwise.
    ``on_block`` gets the bytes in file order, each block as soon as every byte before it has
    arrived."""
    dest = dest.cast("B") if dest.format != "B" else dest
    chunk = chunk or READ_CHUNK
    concurrency = concurrency or READ_CONCURRENCY
    ranges = read_ranges(len(dest), chunk)
    if not ranges:
        return
    if not isinstance(fs, AsyncFileSystem) or concurrency < 2 or len(ranges) == 1:
        for start, end in ranges:
            data = fs.cat_file(path, start=offset + start, end=offset + end)
            _place(dest, start, end, data, path)
            if on_block is not None:
                on_block(dest[start:end])
        return
    # Ranges complete in any order but are taken in file order (the oldest first), so each
    # block goes to on_block (the checksum) while the later ones are still downloading.
    pending: deque[tuple[int, int, Future[Any]]] = deque()
    following = iter(ranges)

    def submit() -> None:
        start, end = next(following, (-1, -1))
        if start >= 0:
            coro = fs._cat_file(path, start=offset + start, end=offset + end)
            pending.append((start, end, asyncio.run_coroutine_threadsafe(coro, fs.loop)))

    try:
        for _ in range(concurrency):
            submit()
        while pending:
            start, end, future = pending.popleft()
            _place(dest, start, end, future.result(), path)
            submit()
            if on_block is not None:
                on_block(dest[start:end])
    except BaseException:
        for _, _, future in pending:
            future.cancel()
        raise


def _place(dest: memoryview, start: int, end: int, data: bytes, path: str) -> None:
    if len(data) != end - start:
        raise OSError(errno.EIO, f"short read: bytes {start}-{end} gave {len(data)} bytes", path)
    dest[start:end] = data


# -- checks before training ---------------------------------------------------------------------
def check_access(fs: fsspec.AbstractFileSystem, root: str, *, write: bool) -> None:
    """Raise (an OSError from the store) unless ``root``'s bucket exists and answers with these
    credentials; with ``write``, an object can also be created and removed under ``root``.

    A missing bucket is not created (s3fs' makedirs would create it): a typo in the URL must fail
    the attempt, not start a checkpoint history in a bucket nobody looks at."""
    if is_s3(fs):
        bucket = fs.split_path(root)[0]
        try:
            sync(fs.loop, fs._call_s3, "head_bucket", Bucket=bucket)
        except FileNotFoundError as exc:
            # HEAD answers carry no error code: say what a 404 of HeadBucket means
            raise FileNotFoundError(
                errno.ENOENT, f"bucket {bucket!r} does not exist (HeadBucket: 404)"
            ) from exc
        except PermissionError as exc:
            raise PermissionError(
                errno.EACCES,
                f"access to bucket {bucket!r} denied (HeadBucket: 403): wrong credentials, or "
                "none that may use this bucket",
            ) from exc
    fs.invalidate_cache(root)
    fs.exists(root)  # a listing: list permission, and an answer with these credentials
    if write:
        probe = f"{root.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex[:12]}"
        upload = open_upload(fs, probe)
        try:
            upload.write(b"preemptible write check\n")
        except BaseException:
            upload.abort()
            raise
        upload.close()
        fs.rm_file(probe)
