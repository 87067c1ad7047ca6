"""Resume falls back from a corrupt checkpoint to the previous complete one.

A checkpoint that passes the completeness rule can still hold bytes that do not match its
manifest (a checksum mismatch: a torn write the size check cannot see, bit rot, a file rewritten
by hand) or lose a listed file between the choice and the load. Loading it fails; left alone,
every attempt would choose it again and fail the same way. So when loading the chosen checkpoint
fails on any rank:

1. each rank classifies its own failure (:func:`classify_failure`): corrupt (a
   :class:`~trainer_runtime.errors.CheckpointCorruptError`, or any other load error for which
   reading the whole checkpoint back against its manifest finds a mismatch) or another error (a
   model that does not fit, storage that cannot be reached: not the checkpoint's fault);
2. the ranks all-gather their outcomes (:func:`gather_outcomes`; every rank calls it, also when
   its own load succeeded) and get the same verdict (:func:`verdict`): any other error fails
   every rank; otherwise any corruption makes every rank fall back;
3. the writer of the directory (rank 0; a node's main process for its own copy under
   ``save_on_each_node``) marks it :data:`~trainer_runtime.checkpoint.layout.CORRUPT_NAME`
   (:func:`mark`), so that no later resume, nor the operator's listing, chooses it again;
4. every rank takes the newest complete checkpoint older than the corrupt one, agreed by all
   ranks (:func:`agree_step`), and loads that.

The Trainer decides what an exhausted fallback means (docs/checkpoints.md, "Resume").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from trainer_runtime.checkpoint.io import verify_checkpoint
from trainer_runtime.checkpoint.layout import attempt_from_env, mark_corrupt
from trainer_runtime.checkpoint.per_node import gather_objects, node_label
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import CheckpointCorruptError, ResumeError

__all__ = [
    "CORRUPT",
    "ERROR",
    "OK",
    "Outcome",
    "agree_step",
    "classify_failure",
    "describe",
    "gather_outcomes",
    "mark",
    "marks_here",
    "verdict",
]

logger = logging.getLogger(__name__)

OK = "ok"
CORRUPT = "corrupt"
ERROR = "error"


@dataclass(frozen=True)
class Outcome:
    """One rank's outcome of loading a checkpoint."""

    rank: int
    node: str
    kind: str  # OK, CORRUPT or ERROR
    message: str | None = None


def classify_failure(path: str, exc: BaseException) -> str | None:
    """Why the checkpoint ``path`` is corrupt, given that loading it raised ``exc``; None when it
    is not (the error is not the checkpoint's fault, or nothing can tell: ``exc`` stands).

    A :class:`CheckpointCorruptError` says so itself. Any other error (a header that does not
    parse, a file that vanished, a value that does not decode) is checked by reading the whole
    checkpoint back against its manifest (:func:`verify_checkpoint`): only a mismatch, or a
    checkpoint that no longer passes the completeness rule, makes it corrupt. A storage error
    during that check (an unreachable store) is no verdict."""
    if isinstance(exc, CheckpointCorruptError):
        return str(exc)
    try:
        verify_checkpoint(path)
    except CheckpointCorruptError as found:
        return f"{found} (loading it failed with {type(exc).__name__}: {exc})"
    except Exception as other:  # cannot tell: the load error is reported as it is
        logger.warning("could not verify %s after its load failed: %s", path, other)
        return None
    return None


def gather_outcomes(kind: str, message: str | None) -> list[Outcome]:
    """Every rank's outcome, in rank order, on every rank (a collective; in one process: ours)."""
    mine = (collectives.rank(), node_label(), kind, message)
    return [Outcome(*fields) for fields in gather_objects(mine)]


def verdict(outcomes: Sequence[Outcome]) -> str:
    """What every rank does, the same on all: ERROR if any rank failed for another reason than
    corruption, else CORRUPT if any rank found corruption, else OK; pure."""
    kinds = {o.kind for o in outcomes}
    if ERROR in kinds:
        return ERROR
    return CORRUPT if CORRUPT in kinds else OK


def describe(outcomes: Sequence[Outcome], kind: str) -> str:
    """The messages of the ranks with outcome ``kind``, ranks that found the same named once."""
    seen: dict[str, list[int]] = {}
    for o in outcomes:
        if o.kind == kind:
            seen.setdefault(o.message or "?", []).append(o.rank)
    if len(outcomes) == 1:
        return "; ".join(seen)
    return "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}" for m, r in seen.items()
    )


def mark(path: str, reason: str) -> str | None:
    """Mark the checkpoint ``path`` corrupt (best effort: a failure is logged, the fallback goes
    on). Returns the marker's path, None when it could not be written."""
    try:
        return mark_corrupt(Storage(path), "", reason, attempt_from_env())
    except Exception as exc:
        logger.error(
            "could not mark %s corrupt (%s); it is skipped by this run only: %s",
            path,
            type(exc).__name__,
            exc,
        )
        return None


def marks_here(outcomes: Sequence[Outcome], *, each_node: bool, local_rank: int) -> bool:
    """Whether this rank writes the marker: rank 0 for one shared copy; with one copy per node,
    the main process of every node where some rank found the corruption; pure apart from
    this rank's identity."""
    if not each_node:
        return collectives.rank() == 0
    if local_rank != 0:
        return False
    here = node_label()
    return any(o.kind == CORRUPT and o.node == here for o in outcomes)


def agree_step(step: int | None) -> int | None:
    """The step every rank found (None: none), or ResumeError when the ranks disagree (they see
    different checkpoints: storage not shared); a collective."""
    value = -1 if step is None else int(step)
    high = collectives.agree_max(value)
    low = -collectives.agree_max(-value)
    if high != low:
        raise ResumeError(
            f"the ranks disagree on the checkpoint to fall back to (steps {low} to {high}): "
            "every rank must see the same output_dir (shared storage), or use "
            "save_on_each_node=True for a copy per node"
        )
    return None if high < 0 else high
