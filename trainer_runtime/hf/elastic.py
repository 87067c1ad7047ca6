"""An elastic attempt of a stock ``transformers.Trainer`` job keeps the global batch.

With ``$PREEMPTIBLE_ELASTIC_REFERENCE_NODES`` / ``$PREEMPTIBLE_ELASTIC_ACCUMULATION`` set, the
Trainer's ``gradient_accumulation_steps`` becomes the one that keeps the reference global batch at
the node count the launcher gave (the rule: :func:`trainer_runtime.elastic.elastic_accumulation`).
transformers 5 runs gradient accumulation itself from ``args`` at ``train()`` (the accelerator is
built with ``num_steps=1``), so changing the argument before ``train()`` is all it takes.

That keeps each optimizer step's samples only because of how transformers and accelerate hand out
data (docs/elastic.md, "Keeping the training the same across sizes"): the seeded permutation is
cut into micro-batches, micro-batch ``k`` goes to rank ``k mod world_size``, so optimizer step
``s`` trains on micro-batches ``[s x M, (s + 1) x M)`` with ``M = world_size x accumulation``,
the same at every size; a resume skips ``steps x accumulation`` micro-batches per rank, the same
``steps x M`` in all. What breaks it is refused here, before training: a sampler that depends on
the accumulation or the world size (``group_by_length``, ``batch_rebalance``), DeepSpeed (its
config took the accumulation at ``TrainingArguments`` time), and an epoch whose micro-batches do
not divide into whole steps when training reaches its end (the last step, and accelerate's
``even_batches`` padding, would differ by size).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from trainer_runtime.elastic import elastic_accumulation
from trainer_runtime.errors import ConfigurationError

__all__ = ["SAMPLERS_KEEPING_ORDER", "apply_elastic", "epoch_keeps_steps"]

logger = logging.getLogger(__name__)

# train_sampling_strategy values whose order depends only on the seed and the dataset's length.
SAMPLERS_KEEPING_ORDER = ("random", "sequential")


def epoch_keeps_steps(
    num_samples: int, batch_size: int, micro_batches_per_step: int, *, drop_last: bool
) -> bool:
    """Whether an epoch of ``num_samples`` cut into micro-batches of ``batch_size`` is whole
    optimizer steps of ``micro_batches_per_step`` (all ranks' micro-batches of one step)."""
    micro_batches = num_samples // batch_size if drop_last else math.ceil(num_samples / batch_size)
    return micro_batches % micro_batches_per_step == 0


def _refuse(reason: str, message: str) -> ConfigurationError:
    return ConfigurationError(f"elastic attempt refused: {reason} ({message})")


def _check_data(trainer: Any, target: int, world_size: int, message: str) -> None:
    args = trainer.args
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in SAMPLERS_KEEPING_ORDER:
        raise _refuse(
            f"train_sampling_strategy={strategy!r} orders samples by the accumulation and world "
            f"size, so another size trains on other samples per step; use one of "
            f"{', '.join(SAMPLERS_KEEPING_ORDER)}",
            message,
        )
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        raise _refuse(
            "DeepSpeed's config took gradient_accumulation_steps when the TrainingArguments were "
            "built; an elastic job under DeepSpeed is not supported",
            message,
        )
    dataset = getattr(trainer, "train_dataset", None)
    try:
        num_samples = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        logger.warning(
            "elastic attempt: the training dataset has no length (an IterableDataset): the "
            "samples of each step at another size are not checked (docs/elastic.md)"
        )
        return
    per_step = world_size * target  # every rank's micro-batches of one optimizer step
    batch = int(args.train_batch_size)
    if epoch_keeps_steps(num_samples, batch, per_step, drop_last=bool(args.dataloader_drop_last)):
        return
    whole_steps = (num_samples // batch) // per_step
    if 0 < args.max_steps <= whole_steps:
        return  # training ends before the first epoch's last, partial step
    global_batch = batch * per_step
    raise _refuse(
        f"an epoch of {num_samples} samples is not whole optimizer steps of {global_batch} "
        f"samples ({per_step} micro-batches of {batch}), so the epoch's last step would train "
        "on other samples at another size; make the training set a multiple of the global "
        f"batch, or max_steps <= {whole_steps}",
        message,
    )


def apply_elastic(trainer: Any, env: Mapping[str, str] | None = None) -> str | None:
    """Set ``trainer.args.gradient_accumulation_steps`` for this elastic attempt and return the
    line logged; None outside an elastic attempt. Idempotent (a second ``train()`` call finds
    the accumulation already at this size). Raises ConfigurationError, naming the sizes that
    work or the shape to change, when the attempt cannot keep the global batch or its samples."""
    env = os.environ if env is None else env
    args = trainer.args
    elastic = elastic_accumulation(int(args.gradient_accumulation_steps), env)
    if elastic is None:
        return None
    target, message = elastic
    world_size = int(env.get("WORLD_SIZE", "1"))
    _check_data(trainer, target, world_size, message)
    args.gradient_accumulation_steps = target
    logger.warning("preemptible: %s", message)
    return message
