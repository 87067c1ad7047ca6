"""Precision and speed options: bf16/fp16 autocast, full-precision-reduced evaluation, TF32,
activation checkpointing, torch.compile, periodic cache emptying, full determinism.

Options that need hardware this process does not have fail with a clear error at setup instead of
silently doing nothing: fp16 needs a CUDA device (CPU autocast is bf16 here), bf16 on CUDA needs
a GPU that supports it, tf32=True needs an Ampere-or-newer NVIDIA GPU.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from typing import Any

import torch

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.arguments import COMPILE_MODES

__all__ = [
    "COMPILE_MODES",
    "autocast_context",
    "device_type_of",
    "empty_device_cache",
    "enable_activation_checkpointing",
    "eval_dtype",
    "maybe_compile",
    "resolve_activation_checkpointing",
    "set_tf32",
    "should_empty_cache",
    "validate_precision",
]

logger = logging.getLogger(__name__)


def device_type_of(device: torch.device | str) -> str:
    return torch.device(device).type


def validate_precision(*, bf16: bool, fp16: bool, device: torch.device | str) -> None:
    """Fail early, naming the option, when the device cannot run the requested precision."""
    dtype = device_type_of(device)
    if bf16 and fp16:
        raise ConfigurationError("bf16=True and fp16=True are exclusive: pick one")
    if fp16 and dtype != "cuda":
        raise ConfigurationError(
            f"fp16=True needs a CUDA device (loss scaling with float16 autocast), but training "
            f"runs on {dtype!r}: use bf16=True on CPU, or run on a GPU"
        )
    if bf16 and dtype == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigurationError(
            "bf16=True but this GPU does not support bfloat16 (needs Ampere or newer): use "
            "fp16=True instead"
        )
    if bf16 and dtype not in ("cpu", "cuda", "xpu", "mps"):
        raise ConfigurationError(f"bf16=True is not supported on device type {dtype!r}")


def autocast_context(
    *, bf16: bool, fp16: bool, device: torch.device | str, cache_enabled: bool | None = True
) -> contextlib.AbstractContextManager[Any]:
    """Autocast for the forward pass (training and evaluation): bfloat16 or float16, or nothing.
    ``cache_enabled``: torch.autocast's weight-cast cache (None: torch's default)."""
    if not (bf16 or fp16):
        return contextlib.nullcontext()
    validate_precision(bf16=bf16, fp16=fp16, device=device)
    dtype = torch.bfloat16 if bf16 else torch.float16
    return torch.autocast(
        device_type=device_type_of(device), dtype=dtype, cache_enabled=cache_enabled
    )


def eval_dtype(*, bf16_full_eval: bool, fp16_full_eval: bool) -> torch.dtype | None:
    """The dtype the model is cast to for evaluation (``*_full_eval``), or None."""
    if bf16_full_eval and fp16_full_eval:
        raise ConfigurationError("bf16_full_eval=True and fp16_full_eval=True are exclusive")
    if bf16_full_eval:
        return torch.bfloat16
    if fp16_full_eval:
        return torch.float16
    return None


def set_tf32(tf32: bool | None) -> None:
    """Apply ``tf32``: None leaves PyTorch's default; True needs Ampere+ CUDA; False disables it."""
    if tf32 is None:
        return
    if tf32:
        if not torch.cuda.is_available():
            raise ConfigurationError(
                "tf32=True needs an NVIDIA GPU of the Ampere generation or newer, and no CUDA "
                "device is available: remove tf32 (or set it to False)"
            )
        major, _ = torch.cuda.get_device_capability()
        if major < 8:
            raise ConfigurationError(
                f"tf32=True needs compute capability >= 8.0 (Ampere), this GPU has {major}.x: "
                "remove tf32"
            )
    torch.backends.cuda.matmul.allow_tf32 = bool(tf32)
    torch.backends.cudnn.allow_tf32 = bool(tf32)


def resolve_activation_checkpointing(
    activation_checkpointing: bool | None,
    activation_checkpointing_kwargs: dict[str, Any] | None,
    gradient_checkpointing: bool | None,
    gradient_checkpointing_kwargs: dict[str, Any] | None,
) -> tuple[bool, dict[str, Any] | None]:
    """Merge the deprecated ``gradient_checkpointing*`` aliases into ``activation_checkpointing*``.

    The alias emits a FutureWarning; contradictory values are an error.
    """
    if gradient_checkpointing is not None or gradient_checkpointing_kwargs is not None:
        warnings.warn(
            "gradient_checkpointing / gradient_checkpointing_kwargs are deprecated aliases: use "
            "activation_checkpointing / activation_checkpointing_kwargs",
            FutureWarning,
            stacklevel=3,
        )
    if (
        activation_checkpointing is not None
        and gradient_checkpointing is not None
        and activation_checkpointing != gradient_checkpointing
    ):
        raise ConfigurationError(
            f"activation_checkpointing={activation_checkpointing!r} contradicts its deprecated "
            f"alias gradient_checkpointing={gradient_checkpointing!r}: set only "
            "activation_checkpointing"
        )
    if (
        activation_checkpointing_kwargs is not None
        and gradient_checkpointing_kwargs is not None
        and activation_checkpointing_kwargs != gradient_checkpointing_kwargs
    ):
        raise ConfigurationError(
            "activation_checkpointing_kwargs contradicts its deprecated alias "
            "gradient_checkpointing_kwargs: set only activation_checkpointing_kwargs"
        )
    enabled = bool(
        activation_checkpointing if activation_checkpointing is not None else gradient_checkpointing
    )
    kwargs = (
        activation_checkpointing_kwargs
        if activation_checkpointing_kwargs is not None
        else gradient_checkpointing_kwargs
    )
    return enabled, kwargs


# Options of transformers' ``activation_checkpointing_enable`` itself; every other key of
# ``activation_checkpointing_kwargs`` goes on to ``torch.utils.checkpoint.checkpoint``.
_CHECKPOINTING_METHOD_OPTIONS = ("every_n_layers", "offload")
_CHECKPOINTING_METHODS = (
    ("activation_checkpointing_enable", "activation_checkpointing_kwargs"),
    ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs"),
)


def _parameters(method: Any) -> tuple[set[str], bool]:
    """Named keyword parameters of ``method`` and whether it takes ``**kwargs``."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return set(), True
    names = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def _checkpointing_call(
    model: torch.nn.Module, name: str, preferred: str, method: Any, options: dict[str, Any]
) -> dict[str, Any]:
    """The keyword arguments for ``method``: the options it names, then the checkpoint kwargs
    under the name it takes (``activation_checkpointing_kwargs`` for transformers 5.x models,
    ``gradient_checkpointing_kwargs`` for older or custom methods)."""
    names, var_kw = _parameters(method)
    call: dict[str, Any] = {}
    for option in _CHECKPOINTING_METHOD_OPTIONS:
        if option not in options:
            continue
        if option not in names and not var_kw:
            raise ConfigurationError(
                f"activation_checkpointing_kwargs[{option!r}] is an option of transformers' "
                f"activation_checkpointing_enable, but {type(model).__name__}.{name}() does not "
                f"take {option!r}: remove it from activation_checkpointing_kwargs"
            )
        call[option] = options.pop(option)
    kwargs_name = next(
        (n for n in (preferred, *(k for _, k in _CHECKPOINTING_METHODS)) if n in names),
        preferred if var_kw else None,
    )
    if kwargs_name is not None:
        # transformers passes None for "no kwargs" (the model then picks use_reentrant=False).
        call[kwargs_name] = options or None
    elif options:
        raise ConfigurationError(
            f"activation_checkpointing_kwargs={options!r} but {type(model).__name__}.{name}() "
            "takes no checkpoint keyword arguments: remove activation_checkpointing_kwargs"
        )
    return call


def enable_activation_checkpointing(
    model: torch.nn.Module, kwargs: dict[str, Any] | None = None
) -> str:
    """Turn on activation checkpointing through the model's own method; returns its name.

    As transformers' Trainer: ``activation_checkpointing_enable`` is preferred (every
    ``PreTrainedModel`` of transformers 5.x has it), ``gradient_checkpointing_enable`` is the
    fallback. ``every_n_layers`` / ``offload`` in ``kwargs`` are the method's own options; the rest
    is handed over as ``activation_checkpointing_kwargs`` (or ``gradient_checkpointing_kwargs``,
    whichever the method takes). A model with neither method cannot be checkpointed generically:
    that is an error, not a silent no-op. ``use_cache`` is not touched here: the Trainer sets
    ``model.config.use_cache`` from ``TrainingArguments.use_cache``, and transformers models drop
    their cache themselves while training with checkpointing.
    """
    for name, preferred in _CHECKPOINTING_METHODS:
        method = getattr(model, name, None)
        if callable(method):
            method(**_checkpointing_call(model, name, preferred, method, dict(kwargs or {})))
            return name
    raise ConfigurationError(
        f"activation_checkpointing=True but {type(model).__name__} has no "
        "activation_checkpointing_enable() or gradient_checkpointing_enable() method: add one "
        "(wrap blocks in torch.utils.checkpoint.checkpoint) or disable activation_checkpointing"
    )


def maybe_compile(
    model: torch.nn.Module,
    *,
    torch_compile: bool,
    backend: str | None = None,
    mode: str | None = None,
) -> torch.nn.Module:
    """``torch.compile`` the model when asked; a backend or mode alone turns compiling on."""
    if not (torch_compile or backend or mode):
        return model
    if mode is not None and mode not in COMPILE_MODES:
        raise ConfigurationError(
            f"torch_compile_mode={mode!r} is not a torch.compile mode: use one of "
            f"{', '.join(COMPILE_MODES)}"
        )
    if backend is not None:
        import torch._dynamo as dynamo

        known = set(dynamo.list_backends(exclude_tags=()))
        if backend not in known:
            raise ConfigurationError(
                f"torch_compile_backend={backend!r} is not available in this PyTorch: use one of "
                f"{', '.join(sorted(known))}"
            )
    kwargs: dict[str, Any] = {}
    if backend is not None:
        kwargs["backend"] = backend
    if mode is not None:
        kwargs["mode"] = mode
    return torch.compile(model, **kwargs)  # type: ignore[return-value]


def should_empty_cache(global_step: int, torch_empty_cache_steps: int | None) -> bool:
    return bool(torch_empty_cache_steps) and global_step % int(torch_empty_cache_steps or 1) == 0


def empty_device_cache(device: torch.device | str) -> bool:
    """Release cached allocator blocks of the device; returns False where there is no cache."""
    dtype = device_type_of(device)
    if dtype == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
        return True
    if dtype == "xpu" and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()
        return True
    if dtype == "mps" and torch.backends.mps.is_available():
        torch.mps.empty_cache()
        return True
    return False
