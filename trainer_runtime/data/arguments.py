"""Data-loading arguments (a pydantic field group for TrainingArguments) and DataLoader assembly.

:class:`DataArguments` holds the Hugging Face dataloader fields with their defaults and checks;
``TrainingArguments`` gets them by inheriting from it. :func:`dataloader_kwargs` turns them into
``DataLoader`` keyword arguments; :func:`build_train_dataloader` builds the training DataLoader
(map-style: a resumable batch sampler; iterable: stream order, ``max_steps`` required);
:func:`set_dataset_epoch` re-seeds iterable datasets every epoch.

Importing this module does not import torch (the argument model is torch-free).
"""

from __future__ import annotations

import logging
import random
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator

from trainer_runtime.errors import ConfigurationError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = [
    "ALL_SAMPLING_STRATEGIES",
    "DataArguments",
    "build_train_dataloader",
    "check_train_dataset",
    "dataloader_kwargs",
    "dataset_state_file_name",
    "has_dataset_state",
    "is_iterable_dataset",
    "iterable_dataset_state",
    "seed_worker",
    "set_dataset_epoch",
    "skip_batches",
]

logger = logging.getLogger(__name__)

ALL_SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length", "batch_rebalance")
SamplingStrategy = Literal["random", "sequential", "group_by_length", "batch_rebalance"]


class DataArguments(BaseModel):
    """Dataloader and data fields of ``TrainingArguments`` (Hugging Face names and defaults)."""

    # -- DataLoader ------------------------------------------------------------------------------
    dataloader_drop_last: bool = Field(
        False, description="Drop the last incomplete batch of each epoch (per rank)."
    )
    dataloader_num_workers: int = Field(
        0, ge=0, description="DataLoader worker processes; 0 loads data in the main process."
    )
    dataloader_pin_memory: bool = Field(
        True, description="Pin host memory for faster copies (only when an accelerator exists)."
    )
    dataloader_persistent_workers: bool = Field(
        False,
        description="Keep worker processes alive between epochs (more RAM, no restart cost); "
        "requires dataloader_num_workers > 0.",
    )
    dataloader_prefetch_factor: int | None = Field(
        None,
        ge=1,
        description="Batches each worker loads ahead (total: factor * workers); requires "
        "dataloader_num_workers > 0. Default: torch's (2).",
    )
    dataloader_multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = Field(
        None,
        description="Start method of the workers; default: torch's. Under 'spawn' the dataset "
        "and collator must be importable at module level (no lambdas or closures).",
    )
    dataloader_in_order: bool = Field(
        True,
        description="Yield batches in dispatch order; False yields them as soon as ready (less "
        "tail latency for streaming datasets).",
    )

    # -- what the model sees ----------------------------------------------------------------------
    remove_unused_columns: bool = Field(
        True,
        description="Drop dataset fields the model's forward does not accept (unless it takes "
        "**kwargs).",
    )
    train_sampling_strategy: SamplingStrategy = Field(
        "random",
        description="Training batch order: 'random', 'sequential', 'group_by_length' (similar "
        "lengths per batch) or 'batch_rebalance' (equal padded cost per micro-batch; data "
        "parallel only). Ignored for iterable datasets.",
    )
    length_column_name: str = Field(
        "length",
        min_length=1,
        description="Column of precomputed sample lengths used by the length-based strategies; "
        "when absent, lengths are inferred by one scan of the dataset.",
    )
    neftune_noise_alpha: float | None = Field(
        None,
        gt=0,
        description="NEFTune noise on the input embeddings during training (typical 5 to 15); "
        "None disables it.",
    )

    @model_validator(mode="after")
    def _check_dataloader(self) -> DataArguments:
        workers = self.dataloader_num_workers
        if workers == 0:
            if self.dataloader_persistent_workers:
                raise ValueError(
                    "dataloader_persistent_workers=True requires dataloader_num_workers > 0 "
                    "(got 0): set dataloader_num_workers to 1 or more, or "
                    "dataloader_persistent_workers=False"
                )
            if self.dataloader_prefetch_factor is not None:
                raise ValueError(
                    f"dataloader_prefetch_factor={self.dataloader_prefetch_factor} requires "
                    "dataloader_num_workers > 0 (got 0): set dataloader_num_workers to 1 or "
                    "more, or leave dataloader_prefetch_factor unset"
                )
        return self


# --------------------------------------------------------------------------------------------
# DataLoader assembly (torch imported lazily)
# --------------------------------------------------------------------------------------------


def seed_worker(worker_id: int) -> None:
    """``worker_init_fn``: seed python's and numpy's RNG from the worker's torch seed.

    torch seeds each worker with ``base_seed + worker_id`` (``base_seed`` drawn from the
    DataLoader's generator); python and numpy would otherwise repeat the parent's state in every
    worker. Module-level so that 'spawn' workers can import it.
    """
    import numpy as np
    import torch

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def _accelerator_available() -> bool:
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def dataloader_kwargs(args: Any) -> dict[str, Any]:
    """``DataLoader`` keyword arguments from the ``dataloader_*`` fields of ``args``.

    Options torch only accepts with workers (``persistent_workers``, ``prefetch_factor``,
    ``multiprocessing_context``) are passed only when ``dataloader_num_workers > 0``;
    ``pin_memory`` only when an accelerator exists (pinning is useless on CPU and warns);
    ``in_order`` only when this torch supports it.
    """
    import inspect

    from torch.utils.data import DataLoader

    from trainer_runtime.data.worker_signals import shielded_worker_init_fn

    workers = int(args.dataloader_num_workers)
    kwargs: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": bool(args.dataloader_pin_memory) and _accelerator_available(),
    }
    if workers > 0:
        kwargs["persistent_workers"] = bool(args.dataloader_persistent_workers)
        if args.dataloader_prefetch_factor is not None:
            kwargs["prefetch_factor"] = int(args.dataloader_prefetch_factor)
        if args.dataloader_multiprocessing_context is not None:
            kwargs["multiprocessing_context"] = args.dataloader_multiprocessing_context
        # Behind the shield: a SIGTERM forwarded to the process group must not kill the workers.
        kwargs["worker_init_fn"] = shielded_worker_init_fn(seed_worker)
        if "in_order" in inspect.signature(DataLoader.__init__).parameters:
            kwargs["in_order"] = bool(args.dataloader_in_order)
        elif not args.dataloader_in_order:
            raise ConfigurationError(
                "dataloader_in_order=False needs torch >= 2.6; upgrade torch or set it to True"
            )
    else:
        if args.dataloader_persistent_workers or args.dataloader_prefetch_factor is not None:
            raise ConfigurationError(
                "dataloader_persistent_workers and dataloader_prefetch_factor require "
                f"dataloader_num_workers > 0 (got {workers}): set dataloader_num_workers >= 1"
            )
    return kwargs


def is_iterable_dataset(dataset: Any) -> bool:
    """True for datasets without random access (torch ``IterableDataset``, streaming datasets)."""
    from torch.utils.data import IterableDataset

    if isinstance(dataset, IterableDataset):
        return True
    return not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))


def check_train_dataset(
    dataset: Any, *, max_steps: int, train_sampling_strategy: str
) -> str | None:
    """Validate the training dataset against the arguments; returns the effective strategy.

    Iterable datasets need ``max_steps > 0`` (their length is unknown) and have no sampler:
    ``None`` is returned, with a warning when a length-based strategy was asked for.
    """
    if not is_iterable_dataset(dataset):
        if len(dataset) == 0:
            raise ConfigurationError("train_dataset is empty: give it at least one example")
        return train_sampling_strategy
    if max_steps is None or max_steps <= 0:
        raise ConfigurationError(
            f"train_dataset is an iterable dataset ({type(dataset).__name__}) without a length, so "
            f"the number of training steps cannot be inferred: set max_steps to a positive "
            f"number of optimizer steps (got max_steps={max_steps})"
        )
    if train_sampling_strategy in ("group_by_length", "batch_rebalance"):
        warnings.warn(
            f"train_sampling_strategy={train_sampling_strategy!r} is ignored for an iterable "
            "dataset (it needs random access and known lengths); batches are taken in stream "
            "order",
            UserWarning,
            stacklevel=2,
        )
    return None


def set_dataset_epoch(dataset: Any, epoch: int, seed: int) -> str | None:
    """Tell a dataset which epoch starts: ``set_epoch(epoch)`` when it has one, else re-seed a
    ``torch.Generator`` held as its ``generator`` attribute with ``seed + epoch``.

    Identical on every rank, so ranks shuffle a stream the same way. Returns what was done.
    """
    import torch

    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
        return "set_epoch"
    generator = getattr(dataset, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed(seed + epoch)
        return "generator"
    return None


def dataset_state_file_name(rank: int, world_size: int) -> str:
    """Checkpoint file of an iterable dataset's own position (one per rank)."""
    return "dataset_state.json" if world_size == 1 else f"dataset_state_{rank}.json"


def iterable_dataset_state(dataset: Any, num_workers: int) -> dict[str, Any] | None:
    """The dataset's own resumable position (``state_dict()``), when it offers one and it is
    exact: with DataLoader workers the dataset is iterated in the worker processes, so the copy
    here never moves (``None``: resume then skips by iteration)."""
    if num_workers > 0 or not has_dataset_state(dataset):
        return None
    state = dataset.state_dict()
    return dict(state) if isinstance(state, Mapping) else None


def has_dataset_state(dataset: Any) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def skip_batches(iterator: Iterator[Any], count: int, *, disable: bool, why: str) -> None:
    """Consume ``count`` batches to restore a data position, with a progress bar and a warning
    that says why it is slow."""
    if count <= 0:
        return
    logger.warning(
        "skipping %d batches of the iterable dataset to restore the data position: %s, so the "
        "batches are read (and collated) again, which may be slow (set ignore_data_skip=True to "
        "start the epoch over instead)",
        count,
        why,
    )
    from tqdm.auto import tqdm

    for _ in tqdm(range(count), desc="skipping to the data position", disable=disable):
        next(iterator)


def build_train_dataloader(
    dataset: Any,
    args: Any,
    *,
    collate_fn: Callable[[list[Any]], Any],
    seed: int,
    batch_size: int | None = None,
    gradient_accumulation_steps: int = 1,
    num_replicas: int = 1,
    rank: int = 0,
    max_steps: int = -1,
    model_input_name: str | None = None,
    parallelism: str = "data",
) -> DataLoader:
    """The training DataLoader for ``args`` (a TrainingArguments with the fields above).

    Map-style datasets get the resumable batch sampler of ``args.train_sampling_strategy`` (its
    ``set_epoch`` / ``load_state_dict`` are on ``loader.batch_sampler``); iterable datasets are
    batched in stream order and need ``max_steps > 0``.
    """
    import torch
    from torch.utils.data import DataLoader

    from trainer_runtime.data import length_sampling  # registers the length-based strategies
    from trainer_runtime.data.samplers import BATCH_SAMPLERS

    batch_size = batch_size or int(args.per_device_train_batch_size)
    kwargs = dataloader_kwargs(args)
    strategy = check_train_dataset(
        dataset, max_steps=max_steps, train_sampling_strategy=args.train_sampling_strategy
    )
    if strategy is None:
        generator = torch.Generator()
        generator.manual_seed(seed)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            drop_last=bool(args.dataloader_drop_last),
            collate_fn=collate_fn,
            generator=generator,
            **kwargs,
        )
    options: dict[str, Any] = {
        "seed": seed,
        "drop_last": bool(args.dataloader_drop_last),
        "num_replicas": num_replicas,
        "rank": rank,
    }
    if strategy in length_sampling.LENGTH_STRATEGIES:
        options.update(
            gradient_accumulation_steps=gradient_accumulation_steps,
            length_column_name=args.length_column_name,
            model_input_name=model_input_name,
            parallelism=parallelism,
        )
    if strategy == "group_by_length":
        # One process: each epoch's order from the global torch RNG, as transformers draws it
        # (the same batches with the same seed; the checkpoint keeps what a resume needs).
        options["order_from_global_rng"] = num_replicas == 1
        if num_replicas > 1 and rank == 0:
            # docs/trainer.md, "Differences from transformers": said at start.
            logger.warning(
                "train_sampling_strategy='group_by_length' with %d ranks: the batch order "
                "differs from transformers' with the same seed (ours is drawn from "
                "data_seed=%d, the same on every rank, and deals samples to the ranks in turn)",
                num_replicas,
                seed,
            )
    factory = BATCH_SAMPLERS.get(strategy)
    if factory is None:
        raise ConfigurationError(
            f"train_sampling_strategy={strategy!r} is not known; use one of "
            f"{', '.join(sorted(BATCH_SAMPLERS))}"
        )
    batch_sampler = factory(dataset, batch_size, **options)
    # Workers' base seed comes from this generator: fixed by the seed, so workers that seed
    # their own RNGs (seed_worker) behave the same in a resumed run.
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        generator=generator,
        **kwargs,
    )
