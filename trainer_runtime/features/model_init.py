"""``Trainer(model_init=...)``: the model is built by a function, again at every ``train()``.

As in transformers, ``model_init`` takes no argument or one (the hyperparameter-search trial),
is called once in ``__init__`` (after the seed is set) and again at the start of every
``train()`` with the seed set first, so every run (and every trial of a hyperparameter search)
starts from a freshly initialized model with a fresh optimizer and scheduler.

:class:`ModelInitMixin` is a base class of :class:`trainer_runtime.trainer.Trainer`; it relies
on the Trainer's ``args``, ``model``, ``model_wrapped``, ``accelerator``, ``callback_handler``,
``optimizer``, ``lr_scheduler`` and ``_init_fsdp``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.precision import (
    enable_activation_checkpointing,
    resolve_activation_checkpointing,
)
from trainer_runtime.trainer_utils import set_seed

__all__ = ["ModelInitMixin", "call_model_init", "resolve_model"]

logger = logging.getLogger(__name__)


def _positional_count(fn: Callable[..., Any]) -> int:
    """Parameters ``fn`` takes positionally (without defaults' optional ones counted, as
    transformers counts them: every named parameter)."""
    params = inspect.signature(fn).parameters.values()
    return sum(
        1
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    )


def call_model_init(model_init: Callable[..., Any], trial: Any = None) -> nn.Module:
    """``model_init()`` or ``model_init(trial)``, by how many arguments it takes."""
    count = _positional_count(model_init)
    if count == 0:
        model = model_init()
    elif count == 1:
        model = model_init(trial)
    else:
        raise ConfigurationError(
            f"model_init takes {count} arguments; it must take none or one (the "
            "hyperparameter-search trial)"
        )
    if model is None:
        raise ConfigurationError("model_init returned None; it must return the model to train")
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"model_init returned a {type(model).__name__}; it must return a torch.nn.Module"
        )
    return model


def resolve_model(
    model: nn.Module | None,
    model_init: Callable[..., Any] | None,
    optimizers: tuple[Any, Any],
) -> nn.Module:
    """The model ``Trainer.__init__`` starts with, checked as transformers checks it: exactly
    one of ``model`` / ``model_init``, and no ready-made optimizer with ``model_init`` (each
    train() builds a new model, which an optimizer made for the old one would not train)."""
    if model is not None and model_init is not None:
        raise ConfigurationError(
            "Trainer got both model and model_init; pass one of them (model_init when each "
            "train() / hyperparameter-search trial must start from a fresh model)"
        )
    if model is None and model_init is None:
        raise ConfigurationError(
            "Trainer requires a model: pass model=<torch.nn.Module> or model_init=<function "
            "returning one>"
        )
    if model_init is not None and (optimizers[0] is not None or optimizers[1] is not None):
        raise ConfigurationError(
            "model_init cannot be combined with optimizers=(optimizer, scheduler): every train() "
            "builds a new model; subclass Trainer and override create_optimizer_and_scheduler "
            "for a custom optimizer"
        )
    if model is None:
        assert model_init is not None
        return call_model_init(model_init)
    return model


class ModelInitMixin:
    # Set by the Trainer; declared for readers and type checkers.
    args: Any
    model: nn.Module
    model_wrapped: nn.Module
    accelerator: Any
    callback_handler: Any
    optimizer: Any
    lr_scheduler: Any
    model_init: Callable[..., Any] | None = None

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """A fresh model from ``model_init`` (given ``trial`` when it takes an argument)."""
        if self.model_init is None:
            raise ConfigurationError("call_model_init() needs Trainer(model_init=...)")
        return call_model_init(self.model_init, trial)

    def _reinit_model(self, trial: Any) -> None:
        """At train() start: seed, rebuild the model from model_init, drop the optimizer and
        scheduler (rebuilt for the new parameters) and everything cached about the old model."""
        args = self.args
        set_seed(args.seed, deterministic=args.full_determinism)
        model = self.call_model_init(trial).to(self.accelerator.device)
        self.model = model
        # What __init__ applies to the model it is given: activation checkpointing, use_cache.
        enabled, ckpt_kwargs = resolve_activation_checkpointing(
            args.activation_checkpointing, args.activation_checkpointing_kwargs, None, None
        )
        if enabled:
            enable_activation_checkpointing(self.model, ckpt_kwargs)
        apply_use_cache = getattr(self, "_apply_use_cache", None)
        if callable(apply_use_cache):
            apply_use_cache()
        cuda = not args.use_cpu and torch.cuda.is_available()
        self._init_fsdp(user_optimizer=False, cuda=cuda)  # type: ignore[attr-defined]
        self.model_wrapped = self.model
        self.optimizer, self.lr_scheduler = None, None
        # Cached facts about the previous model's forward and size.
        self._flos_params = None
        self._accepts_loss_kwargs = None
        self._forward_keys = None
        self._forward_keys_known = False
        self.callback_handler.objects["model"] = self.model

    def _prepare_train(self, trial: Any) -> None:
        """What train() does before anything else, as transformers: a fresh model when
        model_init is given, then the trial's hyperparameters applied to the arguments."""
        if self.model_init is not None:
            self._reinit_model(trial)
        hp_setup = getattr(self, "_hp_search_setup", None)
        if callable(hp_setup):
            hp_setup(trial)
