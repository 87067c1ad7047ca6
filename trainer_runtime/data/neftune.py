"""NEFTune: uniform noise on the token embeddings while training (``neftune_noise_alpha``).

During a training forward pass the input-embedding output ``E`` of shape ``(batch, seq_len, dim)``
becomes ``E + U(-s, s)`` with ``s = alpha / sqrt(seq_len * dim)``; in eval mode nothing changes.
The noise is a forward hook on the embedding module, registered by :func:`activate_neftune` and
removed by :meth:`NEFTuneHandle.remove` (or the :func:`enable_neftune` context manager, which also
removes it when the body raises), leaving the module exactly as it was.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from trainer_runtime.errors import ConfigurationError

__all__ = [
    "NEFTuneHandle",
    "activate_neftune",
    "deactivate_neftune",
    "enable_neftune",
    "find_input_embeddings",
    "neftune_noise",
]

# Embedding modules that currently carry a NEFTune hook (no module attribute is added).
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, NEFTuneHandle] = weakref.WeakKeyDictionary()


def find_input_embeddings(model: nn.Module) -> nn.Module:
    """The token-embedding module: ``model.get_input_embeddings()`` (HF and PEFT models), else
    the model's only ``nn.Embedding``."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        module = getter()
        if isinstance(module, nn.Module):
            return module
    if isinstance(model, nn.Embedding):
        return model
    found = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    if len(found) == 1:
        return found[0]
    raise ConfigurationError(
        f"neftune_noise_alpha needs the model's input embeddings: {type(model).__name__} has no "
        f"get_input_embeddings() and {len(found)} nn.Embedding modules; define "
        "get_input_embeddings() on the model or pass embedding= explicitly"
    )


def neftune_noise(embeddings: torch.Tensor, alpha: float) -> torch.Tensor:
    """``embeddings`` plus uniform noise of scale ``alpha / sqrt(seq_len * dim)``.

    ``seq_len`` is the (padded) second-to-last dimension, ``dim`` the last. Uses the global torch
    RNG, which the runtime checkpoints, so a resumed run draws the same noise.
    """
    if embeddings.ndim < 2:
        raise ConfigurationError(
            "NEFTune expects embeddings of shape (..., seq_len, dim), got "
            f"{tuple(embeddings.shape)}"
        )
    dims = embeddings.shape[-2] * embeddings.shape[-1]
    magnitude = alpha / math.sqrt(dims)
    return embeddings + torch.zeros_like(embeddings).uniform_(-magnitude, magnitude)


class NEFTuneHandle:
    """An active NEFTune hook; :meth:`remove` restores the embedding module (idempotent)."""

    def __init__(self, module: nn.Module, alpha: float) -> None:
        self.module = module
        self.alpha = alpha
        self._hook: Any = module.register_forward_hook(self._forward_hook)

    def _forward_hook(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if module.training:
            return neftune_noise(output, self.alpha)
        return output

    @property
    def active(self) -> bool:
        return self._hook is not None

    def remove(self) -> None:
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        if _ACTIVE.get(self.module) is self:
            del _ACTIVE[self.module]


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ConfigurationError(
            f"neftune_noise_alpha must be a positive number, got {alpha!r}; typical values are "
            "5 to 15, or None to disable NEFTune"
        )
    if not math.isfinite(alpha):
        raise ConfigurationError(f"neftune_noise_alpha must be finite, got {alpha!r}")
    return float(alpha)


def activate_neftune(
    model: nn.Module, alpha: float, *, embedding: nn.Module | None = None
) -> NEFTuneHandle:
    """Add NEFTune noise to ``model``'s input embeddings in training mode; returns the handle."""
    alpha = _check_alpha(alpha)
    module = embedding if embedding is not None else find_input_embeddings(model)
    if module in _ACTIVE:
        raise ConfigurationError(
            f"NEFTune is already active on {type(module).__name__}; deactivate it first "
            "(the noise would be added twice)"
        )
    handle = NEFTuneHandle(module, alpha)
    _ACTIVE[module] = handle
    return handle


def deactivate_neftune(handle: NEFTuneHandle) -> None:
    """Remove the hook of :func:`activate_neftune`; the embeddings behave as before."""
    handle.remove()


@contextmanager
def enable_neftune(
    model: nn.Module, alpha: float | None, *, embedding: nn.Module | None = None
) -> Iterator[NEFTuneHandle | None]:
    """NEFTune for the duration of the block (``alpha=None``: a no-op), removed even on error."""
    if alpha is None:
        yield None
        return
    handle = activate_neftune(model, alpha, embedding=embedding)
    try:
        yield handle
    finally:
        handle.remove()
