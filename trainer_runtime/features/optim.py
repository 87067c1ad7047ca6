"""Optimizers (with weight decay kept off biases and norm weights) and learning-rate schedules."""

from __future__ import annotations

import functools
import importlib.util
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
    "METRIC_SCHEDULES",
    "OPTIMIZERS",
    "SCHEDULES",
    "SCHEDULE_KWARGS",
    "TORCH_OPTIMIZERS",
    "create_optimizer",
    "create_scheduler",
    "decay_parameter_names",
    "is_metric_driven",
    "lr_lambda",
    "optimizer_cls_and_kwargs",
    "parse_optim_args",
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


def create_optimizer(
    model: nn.Module,
    args: TrainingArguments,
    *,
    decay_names: list[str] | None = None,
    cls_and_kwargs: tuple[Any, dict[str, Any]] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer named by ``args.optim`` over two groups: decayed and not decayed.

    ``decay_names`` (default :func:`decay_parameter_names`) and ``cls_and_kwargs`` (default
    :func:`optimizer_cls_and_kwargs`) let the Trainer pass what its overridable methods return.
    """
    decay = set(decay_parameter_names(model) if decay_names is None else decay_names)
    # named_parameters de-duplicates tied weights, so no parameter lands in two groups.
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise ConfigurationError("the model has no trainable parameters (requires_grad=True)")
    groups = [
        {"params": [p for n, p in params if n in decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cls_and_kwargs is None:
        cls_and_kwargs = optimizer_cls_and_kwargs(args, model)
    optimizer_cls, kwargs = cls_and_kwargs
    return optimizer_cls(groups, **dict(kwargs))


def parse_optim_args(text: str | None) -> dict[str, str]:
    """``optim_args`` ('key=value,key=value', spaces ignored) as a dict of strings."""
    if not text:
        return {}
    out: dict[str, str] = {}
    for item in text.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(
                f"optim_args={text!r}: {item!r} is not 'key=value'; write e.g. 'momentum=0.9'"
            )
        out[key] = value
    return out


def _true(text: str) -> bool:
    return text.strip().lower() in ("true", "1", "yes", "y", "on")


def _floats(options: dict[str, str], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: float(options[k]) for k in keys if k in options}


def _require(module: str, optim: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigurationError(
            f"optim={optim!r} needs the {module!r} package, which is not installed: "
            f"{install}, or pick a torch optimizer (adamw_torch, adamw_torch_fused, adafactor, "
            "sgd, adagrad, rmsprop)"
        )


_Built = tuple[Any, dict[str, Any]]


def _adamw(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    kwargs = {**base, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if args.optim == "adamw_torch_fused":
        kwargs["fused"] = True
    return torch.optim.AdamW, kwargs


def _adafactor(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    # transformers' Adafactor (not torch.optim.Adafactor, a different algorithm), with the
    # learning rate of the arguments instead of its relative step.
    _require("transformers", args.optim, "pip install transformers")
    from transformers.optimization import Adafactor

    return Adafactor, {**base, "scale_parameter": False, "relative_step": False}


def _sgd(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    kwargs = {**base, **_floats(options, ("momentum", "dampening", "weight_decay"))}
    if "nesterov" in options:
        kwargs["nesterov"] = _true(options["nesterov"])
    return torch.optim.SGD, kwargs


def _adagrad(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    return torch.optim.Adagrad, {**base, **_floats(options, ("lr_decay", "weight_decay", "eps"))}


def _rmsprop(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    kwargs = {**base, **_floats(options, ("momentum", "alpha", "eps", "weight_decay"))}
    if "centered" in options:
        kwargs["centered"] = _true(options["centered"])
    return torch.optim.RMSprop, kwargs


def _bitsandbytes(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    _require("bitsandbytes", args.optim, "pip install bitsandbytes")
    from bitsandbytes import optim as bnb

    name = args.optim
    betas = (args.adam_beta1, args.adam_beta2)
    extra: dict[str, Any]
    if "ademamix" in name:
        cls = bnb.AdEMAMix
        extra = {
            "betas": (
                float(options.get("beta1", args.adam_beta1)),
                float(options.get("beta2", args.adam_beta2)),
                float(options.get("beta3", 0.9999)),
            ),
            "alpha": float(options.get("alpha", 5.0)),
            "eps": float(options.get("eps", args.adam_epsilon)),
        }
        extra.update({k: int(options[k]) for k in ("t_alpha", "t_beta3") if k in options})
    elif "adam" in name:
        cls, extra = bnb.AdamW, {"betas": betas, "eps": args.adam_epsilon}
    elif "lion" in name:
        cls, extra = bnb.Lion, {"betas": betas}
    else:  # rmsprop_bnb*: the optim_args go to the optimizer as they are
        cls, extra = bnb.RMSprop, dict(options)
    kwargs = {**base, **extra, "optim_bits": 8 if "8bit" in name else 32}
    if "rmsprop" not in name:
        kwargs["is_paged"] = "paged" in name
    return cls, kwargs


def _torchao(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    _require("torchao", args.optim, "pip install 'torchao>=0.11'")
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = AdamW4bit if args.optim == "adamw_torch_4bit" else AdamW8bit
    kwargs = {
        **base,
        "block_size": options.get("block_size", 256),
        "bf16_stochastic_round": _true(options.get("bf16_stochastic_round", "False")),
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
    }
    return cls, kwargs


def _grokadamw(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    _require("grokadamw", args.optim, "pip install grokadamw")
    from grokadamw import GrokAdamW

    defaults = {
        "alpha_init": 0.98,
        "lamb": 2.0,
        "gamma": 0.1,
        "grokking_signal_decay_rate": 0.1,
        "gradient_clipping": 1.0,
    }
    return GrokAdamW, {**base, **{k: float(options.get(k, v)) for k, v in defaults.items()}}


def _stable_adamw(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    _require("optimi", args.optim, "pip install torch-optimi")
    from optimi import StableAdamW

    max_lr = options.get("max_lr")
    kahan = options.get("kahan_sum")
    kwargs = {
        **base,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "decouple_lr": bool(options.get("decouple_lr", False)),
        "max_lr": None if max_lr is None else float(max_lr),
        "kahan_sum": None if kahan is None else bool(kahan),
    }
    return StableAdamW, kwargs


def _anyprecision(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    _require("torchdistx", args.optim, "install https://github.com/pytorch/torchdistx")
    from torchdistx.optimizers import AnyPrecisionAdamW

    kwargs = {
        **base,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "use_kahan_summation": _true(options.get("use_kahan_summation", "False")),
        "momentum_dtype": getattr(torch, options.get("momentum_dtype", "float32")),
        "variance_dtype": getattr(torch, options.get("variance_dtype", "float32")),
        "compensation_buffer_dtype": getattr(
            torch, options.get("compensation_buffer_dtype", "bfloat16")
        ),
    }
    return AnyPrecisionAdamW, kwargs


def _vendor_adamw(args: Any, base: dict[str, Any], options: dict[str, str]) -> _Built:
    adam = {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if args.optim == "adamw_torch_xla":
        _require("torch_xla", args.optim, "install PyTorch/XLA")
        from torch_xla.amp.syncfree import AdamW

        return AdamW, {**base, **adam}
    _require("torch_npu", args.optim, "install torch_npu (Ascend)")
    from torch_npu.optim import NpuFusedAdamW

    return NpuFusedAdamW, {**base, **adam}


# Optimizers that need more than an optimizer object: per-layer hooks (GaLore/APOLLO layerwise),
# a fused backward (LOMO) or train/eval mode switches in the loop (schedule-free).
_LOOP_OPTIMIZERS: dict[str, str] = {
    **dict.fromkeys(
        (
            "galore_adamw",
            "galore_adamw_8bit",
            "galore_adafactor",
            "galore_adamw_layerwise",
            "galore_adamw_8bit_layerwise",
            "galore_adafactor_layerwise",
            "apollo_adamw",
            "apollo_adamw_layerwise",
        ),
        "GaLore/APOLLO low-rank projection (optim_target_modules) is not wired into this "
        "runtime's training loop",
    ),
    "lomo": "LOMO fuses the update into backward, which this runtime's training loop does not do",
    "adalomo": "AdaLomo fuses the update into backward, which this runtime's training loop does "
    "not do",
    **dict.fromkeys(
        ("schedule_free_radam", "schedule_free_adamw", "schedule_free_sgd"),
        "schedule-free optimizers need optimizer.train()/eval() around training and "
        "evaluation, which this runtime's training loop does not call",
    ),
}

_BNB = (
    "adamw_bnb_8bit",
    "adamw_8bit",
    "ademamix",
    "ademamix_8bit",
    "lion_8bit",
    "lion_32bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
)

OPTIMIZERS: dict[str, Callable[[Any, dict[str, Any], dict[str, str]], _Built]] = {
    "adamw_torch": _adamw,
    "adamw_torch_fused": _adamw,
    "adafactor": _adafactor,
    "sgd": _sgd,
    "adagrad": _adagrad,
    "rmsprop": _rmsprop,
    **dict.fromkeys(_BNB, _bitsandbytes),
    "adamw_torch_4bit": _torchao,
    "adamw_torch_8bit": _torchao,
    "grokadamw": _grokadamw,
    "stable_adamw": _stable_adamw,
    "adamw_anyprecision": _anyprecision,
    "adamw_torch_xla": _vendor_adamw,
    "adamw_torch_npu_fused": _vendor_adamw,
}
# Built from torch (and transformers' Adafactor) alone.
TORCH_OPTIMIZERS: tuple[str, ...] = (
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "sgd",
    "adagrad",
    "rmsprop",
)


def optimizer_cls_and_kwargs(args: Any, model: nn.Module | None = None) -> _Built:
    """The optimizer class of ``args.optim`` and its keyword arguments (without the parameters),
    as transformers' ``Trainer.get_optimizer_cls_and_kwargs`` chooses them."""
    name = getattr(args.optim, "value", args.optim)
    if name in _LOOP_OPTIMIZERS:
        raise ConfigurationError(
            f"optim={name!r} is not supported: {_LOOP_OPTIMIZERS[name]}; use one of "
            f"{', '.join(TORCH_OPTIMIZERS)} (or pass your own optimizer with optimizers=(...))"
        )
    build = OPTIMIZERS.get(name)
    if build is None:
        raise ConfigurationError(
            f"optim={name!r} is not a known optimizer; use one of {sorted(OPTIMIZERS)}"
        )
    return build(
        args, {"lr": args.learning_rate}, parse_optim_args(getattr(args, "optim_args", None))
    )


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


def _inverse_sqrt(step: int, *, warmup: int, total: int, timescale: int | None = None) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    scale = timescale if timescale is not None else (warmup or 10_000)
    # 1 / sqrt((step - warmup + scale) / scale): 1.0 at the end of warm-up, then decaying.
    return 1.0 / math.sqrt((step + scale - warmup) / scale)


def _cosine_with_min_lr(
    step: int, *, warmup: int, total: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0
) -> float:
    w = _warmup(step, warmup)
    if w is not None:
        return w
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0.0, cosine * (1 - min_lr_rate) + min_lr_rate)


def _cosine_warmup_with_min_lr(
    step: int,
    *,
    warmup: int,
    total: int,
    num_cycles: float = 0.5,
    min_lr_rate: float = 0.0,
    warmup_lr_rate: float | None = None,
) -> float:
    # Unlike the other schedules, warm-up reaches the full rate at its last step (step + 1), and
    # an explicit warmup_lr_rate is the rate of step 0.
    if step < warmup:
        if warmup_lr_rate is None:
            return (step + 1.0) / max(1.0, float(warmup))
        rate = float(warmup_lr_rate)
        return rate + (1.0 - rate) * step / max(1, warmup - 1)
    progress = (step - warmup + 1.0) / max(1.0, float(total - warmup))
    cosine = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, cosine * (1 - min_lr_rate) + min_lr_rate)


_WSD_SHAPES = ("linear", "cosine", "1-sqrt")


def _wsd_shape(kind: str, progress: float, *, rising: bool, num_cycles: float) -> float:
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "cosine":
        if rising:
            return 0.5 * (1.0 - math.cos(math.pi * progress))
        return 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return 1.0 - math.sqrt(1.0 - progress) if rising else 1.0 - math.sqrt(progress)


def _warmup_stable_decay(
    step: int,
    *,
    warmup: int,
    total: int,
    num_decay_steps: int,
    num_stable_steps: int | None = None,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    stable = total - warmup - num_decay_steps if num_stable_steps is None else num_stable_steps
    if step < warmup:
        rate = _wsd_shape(warmup_type, step / max(1, warmup), rising=True, num_cycles=num_cycles)
        return max(0.0, rate * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < warmup + stable:
        return 1.0
    if step < warmup + stable + num_decay_steps:
        progress = (step - warmup - stable) / max(1, num_decay_steps)
        rate = _wsd_shape(decay_type, progress, rising=False, num_cycles=num_cycles)
        return max(0.0, rate * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


SCHEDULES: dict[str, Callable[..., float]] = {
    "linear": _linear,
    "cosine": _cosine,
    "cosine_with_restarts": _cosine_with_restarts,
    "polynomial": _polynomial,
    "constant": _constant,
    "constant_with_warmup": _constant_with_warmup,
    "inverse_sqrt": _inverse_sqrt,
    "cosine_with_min_lr": _cosine_with_min_lr,
    "cosine_warmup_with_min_lr": _cosine_warmup_with_min_lr,
    "warmup_stable_decay": _warmup_stable_decay,
}

# kwargs each schedule accepts through lr_scheduler_kwargs (transformers' names)
SCHEDULE_KWARGS: dict[str, frozenset[str]] = {
    "linear": frozenset(),
    "cosine": frozenset({"num_cycles"}),
    "cosine_with_restarts": frozenset({"num_cycles"}),
    "polynomial": frozenset({"lr_end", "power"}),
    "constant": frozenset(),
    "constant_with_warmup": frozenset(),
    "inverse_sqrt": frozenset({"timescale"}),
    "cosine_with_min_lr": frozenset({"num_cycles", "min_lr", "min_lr_rate"}),
    "cosine_warmup_with_min_lr": frozenset(
        {"num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"}
    ),
    "warmup_stable_decay": frozenset(
        {
            "num_decay_steps",
            "num_stable_steps",
            "warmup_type",
            "decay_type",
            "min_lr_ratio",
            "num_cycles",
        }
    ),
}

# Schedules stepped with an evaluation metric instead of once per optimizer step.
METRIC_SCHEDULES: tuple[str, ...] = ("reduce_lr_on_plateau", "greedy")


def _min_lr_rate(name: str, kwargs: dict[str, Any], lr_init: float) -> None:
    min_lr, rate = kwargs.pop("min_lr", None), kwargs.get("min_lr_rate")
    if min_lr is not None and rate is not None:
        raise ConfigurationError(
            f"lr_scheduler_kwargs for {name!r}: set min_lr or min_lr_rate, not both"
        )
    if min_lr is not None:
        kwargs["min_lr_rate"] = min_lr / lr_init
    elif rate is None:
        raise ConfigurationError(
            f"lr_scheduler_type={name!r} needs lr_scheduler_kwargs min_lr (a learning rate) or "
            "min_lr_rate (a ratio of learning_rate), e.g. '{\"min_lr_rate\": 0.1}'"
        )


def _check_wsd(kwargs: dict[str, Any]) -> None:
    if "num_decay_steps" not in kwargs:
        raise ConfigurationError(
            "lr_scheduler_type='warmup_stable_decay' needs lr_scheduler_kwargs num_decay_steps "
            "(steps of the final decay), e.g. '{\"num_decay_steps\": 100}'"
        )
    for key in ("warmup_type", "decay_type"):
        if kwargs.get(key, "linear") not in _WSD_SHAPES:
            raise ConfigurationError(
                f"lr_scheduler_kwargs {key}={kwargs[key]!r}: use one of {', '.join(_WSD_SHAPES)}"
            )


def lr_lambda(
    name: str, *, warmup: int, total: int, lr_init: float, kwargs: dict[str, Any] | None = None
) -> Callable[[int], float]:
    """The multiplier function of schedule ``name`` (picklable: a partial of a module function)."""
    if name in METRIC_SCHEDULES:
        raise ConfigurationError(
            f"lr_scheduler_type={name!r} follows an evaluation metric and has no per-step "
            "multiplier; build it with create_scheduler"
        )
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
    elif name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        _min_lr_rate(name, kwargs, lr_init)
    elif name == "warmup_stable_decay":
        _check_wsd(kwargs)
    return functools.partial(SCHEDULES[name], warmup=warmup, total=total, **kwargs)


def _metric_scheduler(name: str, optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> Any:
    try:
        if name == "reduce_lr_on_plateau":
            return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **kwargs)
        _require("transformers", "greedy", "pip install transformers")
        from transformers.optimization import GreedyLR

        return GreedyLR(optimizer, **kwargs)
    except TypeError as exc:
        raise ConfigurationError(f"lr_scheduler_kwargs={kwargs!r} for {name!r}: {exc}") from None


def is_metric_driven(scheduler: Any) -> bool:
    """True for a schedule stepped with an evaluation metric (ReduceLROnPlateau, GreedyLR), which
    the training loop must not step once per optimizer step."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    # GreedyLR is transformers' (optional); recognised by name so transformers stays optional.
    return any(cls.__name__ == "GreedyLR" for cls in type(scheduler).__mro__)


def create_scheduler(
    optimizer: torch.optim.Optimizer,
    args: TrainingArguments,
    max_steps: int,
    *,
    metric_driven: bool = False,
) -> Any:
    """The learning-rate schedule of ``args`` over ``max_steps`` optimizer steps.

    Per-step schedules are a ``LambdaLR``. The metric-driven ones (reduce_lr_on_plateau, greedy)
    are built only for a caller that steps them with the evaluation metric (``metric_driven``);
    otherwise they are refused, since stepping them once per optimizer step would be wrong.
    """
    name = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    kwargs = dict(args.lr_scheduler_kwargs or {})
    if name in METRIC_SCHEDULES:
        if not metric_driven:
            raise ConfigurationError(
                f"lr_scheduler_type={name!r} is stepped with the evaluation metric after each "
                "evaluation, not once per optimizer step: build it with metric_driven=True and "
                "call step(metric) after evaluating (the Trainer does), or use a per-step "
                f"schedule ({', '.join(SCHEDULES)})"
            )
        return _metric_scheduler(name, optimizer, kwargs)
    fn = lr_lambda(
        name,
        warmup=resolve_warmup_steps(args.warmup_steps, max_steps),
        total=max_steps,
        # transformers reads the initial rate from the optimizer (it may be the user's own).
        lr_init=float(optimizer.defaults.get("lr", args.learning_rate)),
        kwargs=kwargs,
    )
    return LambdaLR(optimizer, fn)
