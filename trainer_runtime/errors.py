"""The runtime's exception hierarchy (torch-free).

Every error the runtime raises on purpose derives from :class:`TrainerRuntimeError`, so callers can
catch one class. :class:`ConfigurationError` is also a :class:`ValueError` (bad input), and storage
failures are checkpoint failures (:class:`StorageError` derives from :class:`CheckpointError`).
"""

from __future__ import annotations

import errno

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "ConfigurationError",
    "ResumeError",
    "StorageError",
    "TrainerRuntimeError",
]


class TrainerRuntimeError(Exception):
    """Base class of every error raised by ``trainer_runtime``."""


class ConfigurationError(TrainerRuntimeError, ValueError):
    """A setting or argument has an invalid value; the message names the field and the fix."""


class CheckpointError(TrainerRuntimeError):
    """A checkpoint cannot be written, committed, fenced or rotated."""


class ResumeError(CheckpointError):
    """A checkpoint cannot be resumed from (missing, incomplete or corrupt)."""


class CheckpointCorruptError(ResumeError):
    """A checkpoint that passed the completeness rule does not hold what its manifest lists: a
    checksum or size mismatch, a listed file gone, a manifest no longer readable. Resume marks
    such a checkpoint corrupt and falls back to the previous complete one (docs/checkpoints.md)."""


# errno -> what the user can do about it
_HINTS: dict[int, str] = {
    errno.ENOSPC: "free space on the volume holding the output dir or give it a larger volume",
    errno.EDQUOT: "raise the disk quota of the output dir or free space",
    errno.EFBIG: "the file exceeds the file-size limit of the process or filesystem",
    errno.EROFS: "the filesystem is read-only: mount the output dir read-write",
    errno.EACCES: "check the permissions of the output dir (the pod's user must be able to write)",
    errno.EPERM: "the path is not writable (immutable or permission denied): check the output dir",
    errno.ENOTDIR: "a component of the path is a regular file, not a directory: fix the output dir",
    errno.ENOENT: "the path does not exist: check the output dir URL",
}


class StorageError(CheckpointError):
    """A filesystem or object-store operation failed.

    ``url`` is the full URL of the object, ``operation`` what was being done, ``cause`` the error
    the backend raised (also chained as ``__cause__``), ``endpoint`` the object store's endpoint
    URL where there is one (an S3 URL names the bucket and the key, not the server).
    """

    def __init__(
        self,
        url: str,
        operation: str,
        cause: BaseException | None = None,
        hint: str | None = None,
        endpoint: str | None = None,
    ) -> None:
        self.url = url
        self.operation = operation
        self.cause = cause
        self.endpoint = endpoint
        err = getattr(cause, "errno", None)
        self.errno: int | None = err if isinstance(err, int) else None
        if hint is None and self.errno is not None:
            hint = _HINTS.get(self.errno)
        self.hint = hint
        detail = f"{type(cause).__name__}: {cause}" if cause is not None else "failed"
        where = f"{url!r} at endpoint {endpoint}" if endpoint else repr(url)
        message = f"storage {operation} failed for {where}: {detail}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)

    @property
    def not_found(self) -> bool:
        """True when the backend said the object does not exist."""
        return isinstance(self.cause, FileNotFoundError) or self.errno == errno.ENOENT
