"""Resume falls back from a corrupt checkpoint to the previous complete one.

A checkpoint that passes the completeness rule can still hold bytes that do not match its
manifest (a checksum mismatch: a torn write the size check cannot see, bit rot, a file rewritten
by hand) or lose a listed file between the choice and the load. Loading it fails; left alone,
every attempt would choose it again and fail the same way. So when loading the chosen checkpoint
fails on any rank:

1. each rank reports its outcome (:func:`outcome_of`): a :class:`CheckpointCorruptError` is a
   definite finding (CORRUPT); any other load error (a header that does not parse, a value that
   does not decode, a model that does not fit, a store that cannot be reached) is ERROR;
2. the ranks all-gather their outcomes (:func:`settle`; every rank calls it, also when its own
   load succeeded: the damage may be in another rank's file). Without a definite finding but
   with an error, one reader per copy reads the checkpoint back against its manifest: a mismatch
   (or a listed file gone, a manifest no longer readable) makes it CORRUPT; otherwise the error
   is not the checkpoint's fault and fails every rank, nothing marked;
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
    "corruption_of",
    "describe",
    "gather_outcomes",
    "mark",
    "marks_here",
    "outcome_of",
    "settle",
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


def corruption_of(path: str) -> str | None:
    """Why the checkpoint ``path`` is corrupt, read back whole against its manifest
    (:func:`verify_checkpoint`), or None when it is intact or nothing can tell (a storage error
    during the check, e.g. an unreachable store, is no verdict). A stock transformers checkpoint
    has no checksums: only the completeness rule can call it corrupt."""
    try:
        verify_checkpoint(path)
    except CheckpointCorruptError as found:
        return str(found)
    except Exception as other:  # cannot tell
        logger.warning("could not verify %s after its load failed: %s", path, other)
        return None
    return None


def outcome_of(exc: BaseException | None) -> tuple[str, str | None]:
    """This rank's (kind, message) for a load that raised ``exc`` (None: it succeeded). Only a
    :class:`CheckpointCorruptError` says CORRUPT by itself; any other error is ERROR until
    :func:`settle` had the checkpoint verified."""
    if exc is None:
        return OK, None
    if isinstance(exc, CheckpointCorruptError):
        return CORRUPT, str(exc)
    return ERROR, f"{type(exc).__name__}: {exc}"


def gather_outcomes(kind: str, message: str | None) -> list[Outcome]:
    """Every rank's outcome, in rank order, on every rank (a collective; in one process: ours)."""
    mine = (collectives.rank(), node_label(), kind, message)
    return [Outcome(*fields) for fields in gather_objects(mine)]


def verdict(outcomes: Sequence[Outcome]) -> str:
    """What every rank does, the same on all (pure): CORRUPT if any rank found a mismatch (a
    definite finding: an error elsewhere may well be its consequence, and an older checkpoint
    that still fails for another reason fails then), else ERROR if any rank failed, else OK."""
    kinds = {o.kind for o in outcomes}
    if CORRUPT in kinds:
        return CORRUPT
    return ERROR if ERROR in kinds else OK


def settle(
    kind: str, message: str | None, path: str, *, each_node: bool = False, local_rank: int = 0
) -> tuple[str, list[Outcome]]:
    """Every rank's verdict on loading ``path`` and the outcomes it rests on (collectives: every
    rank calls it, also one whose load succeeded).

    When some rank failed without a definite finding, one reader per copy of the checkpoint
    (rank 0; with one copy per node, the main process of each node where a load failed) reads it
    back against its manifest (:func:`corruption_of`): a mismatch makes it CORRUPT, with the load
    errors as context; otherwise the load error stands (ERROR). So a checkpoint is read back
    once per copy, not once per rank, and only on this failure path."""
    outcomes = gather_outcomes(kind, message)
    agreed = verdict(outcomes)
    if agreed != ERROR:
        return agreed, outcomes
    if each_node:
        here = node_label()
        verifies = local_rank == 0 and any(o.kind == ERROR and o.node == here for o in outcomes)
    else:
        verifies = collectives.rank() == 0
    found = corruption_of(path) if verifies else None
    if found is not None:
        found = f"{found} (loading it failed: {describe(outcomes, ERROR)})"
    checked = gather_outcomes(CORRUPT if found else OK, found)
    if verdict(checked) == CORRUPT:
        return CORRUPT, checked
    return ERROR, outcomes


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
