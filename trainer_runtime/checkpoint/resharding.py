"""Resuming a checkpoint with a different number of ranks: re-sharding the data position.

The resumable batch sampler orders an epoch by a pure function of (seed, epoch) and deals the
indices round-robin: rank ``r`` of ``N`` takes positions ``r, r+N, r+2N, ...``. After every rank
consumed ``k`` batches of ``b`` samples, the ranks together consumed exactly the first ``k*b*N``
positions of the epoch's order. A run with ``M`` ranks of ``b'`` samples covers the same prefix
after ``k' = k*b*N / (b'*M)`` batches, so the position carries over exactly when that divides;
otherwise samples would be repeated or skipped, and the resume is refused with both sizes named.

Everything else in a DDP checkpoint is world-size independent (one copy of the weights, optimizer
and schedule, written by rank 0) except the per-rank RNG states: ranks without a saved RNG state
keep their seeded one, so the continued run is correct but not bit-identical to any other run.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer_runtime.errors import ResumeError

__all__ = ["DataShape", "reshard_position"]


@dataclass(frozen=True)
class DataShape:
    """How a run spreads its data: ranks and samples per rank per micro-batch."""

    world_size: int
    batch_size: int


def reshard_position(
    batch: int,
    saved: DataShape,
    current: DataShape,
    *,
    map_style: bool,
    ignore_data_skip: bool,
    path: str,
) -> int:
    """Micro-batch index (per rank, within the epoch) at which ``current`` resumes a checkpoint
    that ``saved`` wrote at per-rank micro-batch ``batch``.

    Unchanged shape: ``batch``. ``ignore_data_skip``: 0 (the epoch starts over, as documented
    for that flag). Iterable datasets cannot be re-sharded (each rank iterates its own stream).
    Raises ResumeError naming both world sizes when the position cannot carry over exactly.
    """
    if batch < 0:
        raise ResumeError(f"cannot resume from {path}: negative data position {batch}")
    if ignore_data_skip:
        return 0
    if saved == current:
        return batch
    what = (
        f"{path} was written by {saved.world_size} rank(s) x {saved.batch_size} samples per "
        f"micro-batch, this run has {current.world_size} rank(s) x {current.batch_size}"
    )
    if not map_style:
        raise ResumeError(
            f"cannot resume: {what}; the data position of an iterable dataset cannot be "
            f"re-sharded. Resume with {saved.world_size} rank(s), or set ignore_data_skip=True "
            "to start the epoch over"
        )
    consumed = batch * saved.batch_size * saved.world_size
    per_step = current.batch_size * current.world_size
    if consumed % per_step:
        raise ResumeError(
            f"cannot resume: {what}; {consumed} samples of the epoch were consumed, which is not "
            f"a multiple of {per_step}, so the data position cannot carry over exactly. Resume "
            f"with {saved.world_size} rank(s) (or a shape that divides {consumed}), or set "
            "ignore_data_skip=True to start the epoch over"
        )
    return consumed // per_step
