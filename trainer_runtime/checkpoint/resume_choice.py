"""Which checkpoint a resume starts from: one rule for our Trainer and the transformers
integration (torch-free).

``resume_from_checkpoint`` as the caller gave it, or ``$PREEMPTIBLE_RESUME_FROM`` (the operator's)
when the caller gave none: ``latest`` / ``True`` is the newest complete checkpoint (a fresh start
under the operator when there is none, an error for a caller who asked), a path must be
complete. A path the operator passed is the least it may resume from: a newer complete
checkpoint next to it wins (what the operator knew of can be older than what the pods wrote
since), and one a resume has marked corrupt since gives way to the newest complete checkpoint
before it (docs/checkpoints.md, "Resume").
"""

from __future__ import annotations

import logging
import os

from trainer_runtime.checkpoint.layout import CheckpointInfo, CheckpointStore, parse_step
from trainer_runtime.errors import ResumeError
from trainer_runtime.protocol import ENV_RESUME_FROM

__all__ = ["parent_of", "requested_resume", "resolve_in_store"]

logger = logging.getLogger(__name__)


def requested_resume(resume: bool | str | None) -> tuple[bool | str | None, bool]:
    """``(resume, from_env)``: the caller's ``resume``, or, when it is None, what
    ``$PREEMPTIBLE_RESUME_FROM`` asks (``latest`` becomes True; unset or empty: None)."""
    if resume is not None:
        return resume, False
    raw = os.environ.get(ENV_RESUME_FROM, "").strip()
    if not raw:
        return None, False
    return (True if raw.lower() == "latest" else raw), True


def parent_of(path: str) -> str:
    """The directory (URL) holding the checkpoint directory ``path``."""
    head, sep, _ = path.rstrip("/").rpartition("/")
    if not sep:
        return "."
    return head if head and not head.endswith("/") else head + "/"


def resolve_in_store(
    output_dir: str, resume: bool | str, *, from_env: bool
) -> CheckpointInfo | None:
    """The checkpoint to load for ``resume`` (True: the newest complete one of ``output_dir``; a
    path), or None for a fresh start; ``from_env``: the operator asked (see the module)."""
    if resume is True:
        store = CheckpointStore(output_dir)
        for info in store.incomplete():
            logger.warning("skipping incomplete checkpoint %s: %s", info.path, info.reason)
        latest = store.latest_complete()
        if latest is None:
            if from_env:
                logger.info(
                    "%s=latest but %s has no complete checkpoint: starting from scratch",
                    ENV_RESUME_FROM,
                    output_dir,
                )
                return None
            raise ResumeError(
                f"resume_from_checkpoint=True but {output_dir} has no complete checkpoint; "
                "train without resume_from_checkpoint or pass a checkpoint path"
            )
        logger.info("resuming from the newest complete checkpoint %s", latest.path)
        return latest
    path = str(resume)
    info = CheckpointStore(output_dir).inspect(path)
    if from_env and parse_step(info.name) is not None:
        newer = CheckpointStore(parent_of(info.path)).latest_complete()
        if newer is not None and newer.step > info.step:
            # Resuming from the older one would train the steps between them again and then
            # overwrite the newer checkpoint with this run's state of its step.
            logger.warning(
                "%s=%s, but %s (step %d) is complete and newer: resuming from it (a path from "
                "the operator is the least a resume may start from; what it knew of can be "
                "older than the newest complete checkpoint)",
                ENV_RESUME_FROM,
                path,
                newer.path,
                newer.step,
            )
            return newer
    if not info.complete and from_env and info.corrupt:
        # The operator passes the newest complete checkpoint it knew (never an older one than
        # the runtime reported); one a resume marked corrupt since gives way to the newest
        # complete one before it, as "latest" would.
        older = CheckpointStore(parent_of(info.path)).latest_complete(below=info.step)
        if older is not None:
            logger.error(
                "%s=%s is not usable (%s): resuming from %s, the newest complete checkpoint "
                "before it",
                ENV_RESUME_FROM,
                path,
                info.reason,
                older.path,
            )
            return older
        # what "latest" does when no complete checkpoint is left (the model is untouched)
        logger.error(
            "%s=%s is marked corrupt (%s) and no complete checkpoint precedes it: "
            "starting from scratch",
            ENV_RESUME_FROM,
            path,
            info.reason,
        )
        return None
    if not info.complete:
        raise ResumeError(f"cannot resume from {path}: {info.reason or 'checkpoint incomplete'}")
    return info
