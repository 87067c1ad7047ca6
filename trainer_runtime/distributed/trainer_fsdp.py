"""FSDP in the Trainer (``fsdp`` / ``fsdp_config``): a mixin of :class:`trainer_runtime.Trainer`.

With FSDP on, the Trainer shards the model with
:func:`~trainer_runtime.distributed.fsdp.shard_model` at construction (accelerate never wraps it in
DDP), builds the optimizer over the sharded parameters, and writes every checkpoint (periodic, JIT,
best, in the background with ``save_async``) through the Trainer's usual writer: each rank writes
its own file of pieces of the model and optimizer state
(:func:`~trainer_runtime.distributed.fsdp.local_state_file`), next to the files a DDP checkpoint
has (scheduler, per-rank RNG state, trainer state with the data position, training arguments);
with ``state_dict_type='FULL_STATE_DICT'`` periodic checkpoints also hold the gathered
``model.safetensors``, JIT checkpoints never. The manifest commits them all at once. Resume loads
the pieces with :func:`~trainer_runtime.distributed.fsdp.load_sharded` at any number of ranks,
refusing incomplete checkpoints like every other reader. ``save_model`` always writes the gathered
weights.

Relies on these Trainer attributes: ``args``, ``model``, ``optimizer``, ``accelerator``,
``state``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainer_runtime.checkpoint.layout import CheckpointInfo
from trainer_runtime.checkpoint.model_state import MODEL_NAME
from trainer_runtime.distributed import collectives
from trainer_runtime.distributed.fsdp_args import check_fsdp_runtime, fsdp_settings

__all__ = ["FsdpTrainerMixin"]

logger = logging.getLogger(__name__)


class FsdpTrainerMixin:
    """The FSDP code paths of the Trainer; every method is a no-op branch when FSDP is off."""

    args: Any
    model: nn.Module
    accelerator: Any
    optimizer: torch.optim.Optimizer | None
    state: Any
    _fsdp: Any

    def _init_fsdp(self, *, user_optimizer: bool, cuda: bool) -> None:
        """Validate the FSDP arguments against this machine and shard ``self.model``."""
        self._fsdp = None
        settings = fsdp_settings(self.args)
        if settings is None:
            return
        check_fsdp_runtime(
            self.args,
            world_size=collectives.world_size(),
            cuda=cuda,
            user_optimizer=user_optimizer,
        )
        from trainer_runtime.distributed.fsdp import FsdpConfig, shard_model

        self._fsdp = FsdpConfig(**settings)
        self.model = shard_model(self.model, self._fsdp)
        logger.info(
            "FSDP: model sharded over %d ranks (%s, wrap=%s)",
            collectives.world_size(),
            "full_shard" if self._fsdp.reshard_after_forward else "shard_grad_op",
            self._fsdp.wrap,
        )

    @property
    def is_fsdp_enabled(self) -> bool:
        """The model is sharded (Hugging Face name)."""
        return self._fsdp is not None

    # -- training step -----------------------------------------------------------------------------
    def _no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Skip the gradient reduction of a micro-batch that is not the last of its step."""
        if self._fsdp is None:
            return self.accelerator.no_sync(model)  # type: ignore[no-any-return]
        return _fsdp_no_sync(model)

    @staticmethod
    def _grad_norm_value(norm: Any) -> float:
        # Under FSDP the norm is a DTensor whose local value is partial: gather it first.
        full = getattr(norm, "full_tensor", None)
        return float(full() if callable(full) else norm)

    # -- checkpoints -------------------------------------------------------------------------------
    def _fsdp_entries(self, main: bool, jit: bool) -> list[tuple[str, Any]]:
        """This rank's file of the sharded model (and optimizer) state: its own pieces, written
        at the same time as every other rank's, nothing gathered. A periodic save with
        ``state_dict_type='FULL_STATE_DICT'`` also writes the gathered ``model.safetensors``
        (a collective: every rank takes part, the coordinator writes it); a JIT save never
        does, its deadline is the whole point."""
        from trainer_runtime.checkpoint.hf_format import model_weights
        from trainer_runtime.distributed.fsdp import full_state_tensors, local_state_file

        optimizer = None if self.args.save_only_model else self.optimizer
        rank, world = collectives.rank(), collectives.world_size()
        entries: list[tuple[str, Any]] = [local_state_file(self.model, optimizer, rank, world)]
        config = self.args.fsdp_config
        if not jit and config is not None and config.state_dict_type == "FULL_STATE_DICT":
            gathered = full_state_tensors(self.model)
            weights = model_weights(self.model, gathered=gathered) if main else None
            if weights is not None:
                entries.append((MODEL_NAME, weights))
        return entries

    def _manifest_extra(self) -> dict[str, Any]:
        """What the manifest records besides the files: under FSDP, that the state is sharded."""
        if self._fsdp is None:
            return {}
        from trainer_runtime.distributed.fsdp import sharded_manifest_entry

        return sharded_manifest_entry(
            collectives.world_size(), optimizer=not self.args.save_only_model
        )

    def _load_model_shards(self, info: CheckpointInfo) -> bool:
        """Load the shards of ``info`` into the sharded model, and into the optimizer when the
        checkpoint has its shards; returns whether the optimizer state was restored."""
        from trainer_runtime.distributed.fsdp import load_sharded, sharded_manifest
        from trainer_runtime.errors import ResumeError

        entry = sharded_manifest(info)
        if entry is None:
            raise ResumeError(
                f"cannot resume from {info.path} with fsdp={' '.join(self.args.fsdp)!r}: it is "
                "not a sharded checkpoint (it was written without FSDP); resume it without fsdp"
            )
        with_optimizer = self.optimizer is not None and entry.get("optimizer", True) is not False
        load_sharded(info.path, self.model, self.optimizer if with_optimizer else None)
        return with_optimizer

    def _gathered_model_tensors(self) -> dict[str, torch.Tensor] | None:
        """The full weights on the main process (a collective under FSDP; None: not sharded)."""
        if self._fsdp is None:
            return None
        from trainer_runtime.distributed.fsdp import full_state_tensors

        return full_state_tensors(self.model)

    def _load_best_model_at_end(self) -> bool:
        """Under FSDP the best checkpoint's model shards are loaded (every rank)."""
        if self._fsdp is None:
            return bool(super()._load_best_model_at_end())  # type: ignore[misc]
        path = self.state.best_model_checkpoint
        if not self.args.load_best_model_at_end or not path:
            return False
        from trainer_runtime.distributed.fsdp import load_sharded

        load_sharded(path, self.model)
        logger.info("loaded the best model's shards from %s", path)
        return True


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:  # not an FSDP module (e.g. compiled wrapper): reduce every micro-batch
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)
