"""Optimizers (with weight decay kept off biases and norm weights) and learning-rate schedules."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainer_runtime.errors import ConfigurationError

if TYPE_CHECKING:
    from trainer_runtime.training_args import TrainingArguments

__all__ = [
    "SCHEDULES",
    "create_optimizer",
    "create_scheduler",
    "decay_parameter_names",
    "lr_lambda",
    "resolve_warmup_steps",
]

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def _is_norm(module: nn.Module) -> bool:
    # Custom norms (LlamaRMSNorm, T5LayerNorm...) are recognised by their class name.
    return isinstance(module, _NORM_TYPES) or "norm" in type(module).__name__.lower()


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the trainable parameters weight decay applies to: not biases, not norm weights."""
    names: list[str] = []
    for module_name, module in model.named_modules():
        norm = _is_norm(module)
        for param_name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or norm or param_name == "bias":
                continue
            names.append(f"{module_name}.{param_name}" if module_name else param_name)
    return names


def create_optimizer(model: nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
    """The optimizer named by ``args.optim`` over two groups: decayed and not decayed."""
    decay = set(decay_parameter_names(model))
    # named_parameters de-duplicates tied weights, so no parameter lands in two groups.
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ConfigurationError("the model has no trainable parameters (requires_grad=True)")
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if args.optim == "sgd":
        return torch.optim.SGD(groups, lr=args.learning_rate)
    kwargs: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
    }
    if args.optim == "adamw_torch_fused":
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, **kwargs)


def resolve_warmup_steps(warmup_steps: float, max_steps: int) -> int:
    """``warmup_steps`` >= 1 is a step count; below 1 a ratio of ``max_steps`` (rounded up)."""
    if warmup_steps >= 1:
        return int(warmup_steps)
    return math.ceil(warmup_steps * max_steps)


# -- schedules: multiplier of the initial learning rate at a step ----------------------------------
def _warmup(step: int, warmup: int) -> float | None:
    return step / max(1, warmup) if step < warmup else None


def _constant(step: int, *, warmup: int, total: int) -> float:
    return 1.0


def _constant_with_warmup(step: int, *, warmup: int, total: int) -> float:
    w = _warmup(step, warmup)
    return 1.0 if w is None else w


def _linear(step: int, *, warmup: int, total: int) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    return max(0.0, (total - step) / max(1, total - warmup))


def _cosine(step: int, *, warmup: int, total: int, num_cycles: float = 0.5) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))


def _cosine_with_restarts(step: int, *, warmup: int, total: int, num_cycles: int = 1) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    progress = (step - warmup) / max(1, total - warmup)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def _polynomial(
    step: int, *, warmup: int, total: int, lr_init: float, lr_end: float = 1e-7, power: float = 1.0
) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    if step > total:
        return lr_end / lr_init
    remaining = 1 - (step - warmup) / max(1, total - warmup)
    return ((lr_init - lr_end) * remaining**power + lr_end) / lr_init


SCHEDULES: dict[str, Callable[..., float]] = {
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_restarts": _cosine_with_restarts,
    "polynomial": _polynomial,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
}

# kwargs each schedule accepts through lr_scheduler_kwargs
SCHEDULE_KWARGS: dict[str, frozenset[str]] = {
    "linear": frozenset(),
    "cosine": frozenset({"num_cycles"}),
    "cosine_with_restarts": frozenset({"num_cycles"}),
    "polynomial": frozenset({"lr_end", "power"}),
    "constant": frozenset(),
    "constant_with_warmup": frozenset(),
}


def lr_lambda(
    name: str, *, warmup: int, total: int, lr_init: float, kwargs: dict[str, Any] | None = None
) -> Callable[[int], float]:
    """The multiplier function of schedule ``name`` (picklable: a partial of a module function)."""
    if name not in SCHEDULES:
        raise ConfigurationError(
            f"lr_scheduler_type={name!r} is not supported; use one of {sorted(SCHEDULES)}"
        )
    kwargs = dict(kwargs or {})
    unknown = set(kwargs) - SCHEDULE_KWARGS[name]
    if unknown:
        raise ConfigurationError(
            f"lr_scheduler_kwargs={kwargs!r}: {sorted(unknown)} not accepted by {name!r}; "
            f"accepted: {sorted(SCHEDULE_KWARGS[name]) or 'none'}"
        )
    if name == "polynomial":
        kwargs["lr_init"] = lr_init
        if kwargs.get("lr_end", 1e-7) > lr_init:
            raise ConfigurationError(
                f"lr_scheduler_kwargs lr_end={kwargs['lr_end']!r} must not exceed "
                f"learning_rate={lr_init!r}"
            )
    return functools.partial(SCHEDULES[name], warmup=warmup, total=total, **kwargs)


def create_scheduler(
    optimizer: torch.optim.Optimizer, args: TrainingArguments, max_steps: int
) -> LambdaLR:
    """The learning-rate schedule of ``args`` over ``max_steps`` optimizer steps."""
    fn = lr_lambda(
        args.lr_scheduler_type,
        warmup=resolve_warmup_steps(args.warmup_steps, max_steps),
        total=max_steps,
        lr_init=args.learning_rate,
        kwargs=args.lr_scheduler_kwargs,
    )
    return LambdaLR(optimizer, fn)
