"""FSDP arguments (``fsdp``, ``fsdp_config``) as one pydantic field group, and what the Trainer
derives from them.

:class:`FsdpArguments` is a base class of ``TrainingArguments``: Hugging Face names and accepted
values, validated at construction. What depends on the machine (CUDA, number of ranks) is checked
when the Trainer starts, by :func:`check_fsdp_runtime`. :func:`fsdp_settings` maps the arguments
onto the keyword arguments of :class:`trainer_runtime.distributed.fsdp.FsdpConfig`.

The runtime shards with FSDP2 (``fully_shard``). Options of the FSDP1 wrapper that FSDP2 has no
equivalent for are refused with the reason, never silently ignored. Torch-free at import.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer_runtime.distributed.ddp_args import load_json_or_path
from trainer_runtime.errors import ConfigurationError

__all__ = [
    "FSDP_OPTIONS",
    "FsdpArguments",
    "FsdpConfigArguments",
    "check_fsdp_runtime",
    "fsdp_enabled",
    "fsdp_settings",
]

# The Hugging Face ``fsdp`` options, in their documented spelling.
FSDP_OPTIONS: tuple[str, ...] = (
    "full_shard",
    "shard_grad_op",
    "hybrid_shard",
    "hybrid_shard_zero2",
    "no_shard",
    "offload",
    "auto_wrap",
)
_STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "hybrid_shard_zero2", "no_shard")
_REFUSED_STRATEGIES = {
    "hybrid_shard": "hybrid sharding needs a 2-D device mesh (replicate across nodes, shard "
    "within a node), which this runtime does not build",
    "hybrid_shard_zero2": "hybrid sharding needs a 2-D device mesh (replicate across nodes, "
    "shard within a node), which this runtime does not build",
    "no_shard": "no_shard replicates the whole model on every rank, which is what plain data "
    "parallelism (DDP) already does: leave fsdp unset to train with DDP",
}


class FsdpConfigArguments(BaseModel):
    """The ``fsdp_config`` keys (Hugging Face names; a ``fsdp_`` prefix is accepted and dropped)."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(2, description="FSDP version: 2 (fully_shard). FSDP1 is not supported.")
    reshard_after_forward: bool | None = Field(
        None,
        description="Free the gathered parameters after forward (True, ZeRO-3) or keep them "
        "until backward (False, ZeRO-2). None: from the fsdp strategy (full_shard: True, "
        "shard_grad_op: False).",
    )
    cpu_offload: bool = Field(
        False, description="Offload parameters and gradients to host memory (needs CUDA)."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute the activations of every wrapped unit during backward (needs "
        "auto wrapping: units other than the root).",
    )
    cpu_ram_efficient_loading: bool = Field(
        False,
        description="Rank 0's weights are broadcast to the other ranks before sharding (they "
        "are broadcast anyway while sync_module_states is True).",
    )
    sync_module_states: bool = Field(
        True,
        description="Broadcast parameters and buffers from rank 0 before sharding, so every "
        "rank starts from the same weights (as DDP does).",
    )
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] = Field(
        "SHARDED_STATE_DICT",
        description="Checkpoints always hold the sharded state (resume), each rank writing its "
        "own shards. FULL_STATE_DICT also writes the gathered model.safetensors (rank 0 holds "
        "the whole model in host memory while it writes) into every periodic checkpoint, never "
        "into a JIT one; save_model() always writes it. The default is accelerate's for FSDP2.",
    )
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] | None = (
        Field(
            None,
            description="Which submodules become their own FSDP unit. None: with the 'auto_wrap' "
            "option, SIZE_BASED_WRAP when min_num_params > 0, else TRANSFORMER_BASED_WRAP; "
            "without it, NO_WRAP (only the root).",
        )
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        None,
        description="Class names of the layers to wrap (TRANSFORMER_BASED_WRAP). None: the "
        "model's _no_split_modules.",
    )
    min_num_params: int = Field(
        0, ge=0, description="Minimum parameters of a unit under SIZE_BASED_WRAP."
    )
    use_orig_params: bool = Field(
        True, description="FSDP1 option; FSDP2 always keeps the original parameters (True)."
    )
    forward_prefetch: bool = Field(
        False, description="FSDP1 option; FSDP2 does not prefetch in forward (False)."
    )
    backward_prefetch: str | None = Field(
        None,
        description="FSDP1 option; FSDP2 prefetches the next unit in backward, which is "
        "BACKWARD_PRE. None or 'backward_pre'.",
    )
    limit_all_gathers: bool = Field(
        True, description="FSDP1 option; FSDP2 bounds in-flight all-gathers itself (True)."
    )
    xla: bool = Field(False, description="PyTorch/XLA FSDP. Not supported (False).")
    xla_fsdp_settings: dict[str, Any] | None = Field(
        None, description="PyTorch/XLA FSDP settings. Not supported (None)."
    )
    xla_fsdp_grad_ckpt: bool = Field(
        False, description="PyTorch/XLA gradient checkpointing. Not supported (False)."
    )

    @model_validator(mode="before")
    @classmethod
    def _strip_prefix(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        out: dict[str, Any] = {}
        for key, value in data.items():
            name = str(key)
            name = name.removeprefix("fsdp_") if name.startswith("fsdp_") else name
            if name in out:
                raise ValueError(f"{key!r} given twice (with and without the fsdp_ prefix)")
            out[name] = value
        return out

    @field_validator("transformer_layer_cls_to_wrap", mode="before")
    @classmethod
    def _layer_list(cls, value: Any) -> Any:
        # Hugging Face accepts one name or a comma-separated string as well as a list.
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value

    @field_validator("backward_prefetch", mode="before")
    @classmethod
    def _prefetch(cls, value: Any) -> Any:
        if value is None or value is False:
            return None
        name = str(value).strip().lower()
        if name in ("", "backward_pre"):
            return name or None
        raise ValueError(
            f"{value!r} is an FSDP1 prefetch mode; FSDP2 always prefetches the next unit before "
            "its backward (backward_pre): use 'backward_pre' or leave it unset"
        )

    @model_validator(mode="after")
    def _supported(self) -> FsdpConfigArguments:
        if self.version != 2:
            raise ValueError(
                f"version={self.version}: only FSDP2 (fully_shard) is supported; use version=2"
            )
        if not self.use_orig_params:
            raise ValueError(
                "use_orig_params=False is an FSDP1 flat-parameter mode; FSDP2 always keeps the "
                "original parameters: remove it or set it to True"
            )
        if self.forward_prefetch:
            raise ValueError(
                "forward_prefetch=True is not supported with FSDP2 in this runtime: remove it"
            )
        if not self.limit_all_gathers:
            raise ValueError(
                "limit_all_gathers=False is an FSDP1 rate-limiter switch FSDP2 does not have: "
                "remove it"
            )
        if self.xla or self.xla_fsdp_settings or self.xla_fsdp_grad_ckpt:
            raise ValueError(
                "xla, xla_fsdp_settings and xla_fsdp_grad_ckpt need PyTorch/XLA, which this "
                "runtime does not support: remove them"
            )
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise ValueError(
                "cpu_ram_efficient_loading=True needs sync_module_states=True (the other ranks "
                "receive rank 0's weights by broadcast)"
            )
        if self.auto_wrap_policy == "SIZE_BASED_WRAP" and self.min_num_params <= 0:
            raise ValueError(
                "auto_wrap_policy='SIZE_BASED_WRAP' needs min_num_params > 0 (parameters per unit)"
            )
        if self.auto_wrap_policy == "NO_WRAP" and self.activation_checkpointing:
            raise ValueError(
                "activation_checkpointing=True checkpoints the wrapped units, but "
                "auto_wrap_policy='NO_WRAP' wraps none: use SIZE_BASED_WRAP or "
                "TRANSFORMER_BASED_WRAP"
            )
        return self


class FsdpArguments(BaseModel):
    """Fully sharded data parallel fields of ``TrainingArguments``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    fsdp: list[str] = Field(
        default_factory=list,
        description="Shard the model with FSDP2 over the ranks: a space-separated string or list "
        "of full_shard (ZeRO-3), shard_grad_op (ZeRO-2), offload (CUDA only) and auto_wrap; "
        "True means 'full_shard'. hybrid_shard, hybrid_shard_zero2 and no_shard are refused. "
        "Empty/None/False: no FSDP.",
    )
    fsdp_config: FsdpConfigArguments | None = Field(
        None,
        description="FSDP settings: a dict, a JSON string or the path of a JSON file with keys "
        "version, reshard_after_forward, cpu_offload, activation_checkpointing, "
        "cpu_ram_efficient_loading, sync_module_states, state_dict_type, auto_wrap_policy, "
        "transformer_layer_cls_to_wrap, min_num_params (and the FSDP1 keys use_orig_params, "
        "forward_prefetch, backward_prefetch, limit_all_gathers at their FSDP2 values).",
    )

    @field_validator("fsdp", mode="before")
    @classmethod
    def _parse_fsdp(cls, value: Any) -> Any:
        if value is None or value is False:
            return []
        if value is True:
            return ["full_shard"]
        if isinstance(value, str):
            value = value.split()
        if not isinstance(value, (list, tuple)):
            raise ValueError("use a space-separated string, a list of options, True or None")
        options: list[str] = []
        for item in value:
            name = str(getattr(item, "value", item)).strip().lower()
            if name not in FSDP_OPTIONS:
                raise ValueError(f"unknown option {item!r}; use any of {', '.join(FSDP_OPTIONS)}")
            if name in _REFUSED_STRATEGIES:
                raise ValueError(f"{name!r} is not supported: {_REFUSED_STRATEGIES[name]}")
            if name not in options:
                options.append(name)
        strategies = [o for o in options if o in _STRATEGIES]
        if len(strategies) > 1:
            raise ValueError(
                f"{' and '.join(strategies)} are exclusive sharding strategies: keep one"
            )
        return options

    @field_validator("fsdp_config", mode="before")
    @classmethod
    def _parse_config(cls, value: Any) -> Any:
        if value is None:
            return None
        return load_json_or_path(value)

    @model_validator(mode="after")
    def _fsdp_cross_checks(self) -> FsdpArguments:
        config = self.fsdp_config
        if config is None:
            return self
        if not self.fsdp:
            warnings.warn(
                "fsdp_config is set but fsdp is not: the config is ignored (set fsdp='full_shard' "
                "to shard the model)",
                UserWarning,
                stacklevel=2,
            )
            return self
        strategy = next((o for o in self.fsdp if o in _STRATEGIES), None)
        wanted = {"full_shard": True, "shard_grad_op": False}.get(strategy or "")
        if (
            wanted is not None
            and config.reshard_after_forward is not None
            and config.reshard_after_forward != wanted
        ):
            raise ValueError(
                f"fsdp={strategy!r} means reshard_after_forward={wanted}, but fsdp_config has "
                f"reshard_after_forward={config.reshard_after_forward}: drop one of them"
            )
        return self


# ------------------------------------------------------------------------------------------------
# what the Trainer derives from these fields
# ------------------------------------------------------------------------------------------------


def fsdp_enabled(args: Any) -> bool:
    return bool(getattr(args, "fsdp", None))


def fsdp_settings(args: Any) -> dict[str, Any] | None:
    """Keyword arguments of :class:`~trainer_runtime.distributed.fsdp.FsdpConfig` (None: no FSDP).

    Pure: the model-dependent part (which classes a TRANSFORMER_BASED_WRAP wraps when none are
    named) is resolved by ``shard_model``.
    """
    options = list(getattr(args, "fsdp", None) or [])
    if not options:
        return None
    config = args.fsdp_config or FsdpConfigArguments()
    if config.reshard_after_forward is not None:
        reshard = config.reshard_after_forward
    else:
        reshard = "shard_grad_op" not in options
    policy = config.auto_wrap_policy
    if policy is None:
        if "auto_wrap" in options:
            policy = "SIZE_BASED_WRAP" if config.min_num_params > 0 else "TRANSFORMER_BASED_WRAP"
        else:
            policy = "NO_WRAP"
    if config.activation_checkpointing and policy == "NO_WRAP":
        raise ConfigurationError(
            "fsdp_config.activation_checkpointing=True checkpoints the wrapped units, but "
            f"fsdp={' '.join(options)!r} wraps none (only the root): add 'auto_wrap' to fsdp or "
            "set fsdp_config.auto_wrap_policy"
        )
    wrap = {"TRANSFORMER_BASED_WRAP": "transformer", "SIZE_BASED_WRAP": "size", "NO_WRAP": "none"}
    return {
        "reshard_after_forward": reshard,
        "cpu_offload": "offload" in options or config.cpu_offload,
        "wrap": wrap[policy],
        "layer_classes": tuple(config.transformer_layer_cls_to_wrap or ()),
        "min_num_params": config.min_num_params,
        "sync_module_states": config.sync_module_states or config.cpu_ram_efficient_loading,
        "activation_checkpointing": config.activation_checkpointing,
    }


def check_fsdp_runtime(
    args: Any, *, world_size: int, cuda: bool, user_optimizer: bool = False
) -> None:
    """Refuse, before anything is sharded, what this machine or setup cannot run with FSDP."""
    options = list(getattr(args, "fsdp", None) or [])
    if not options:
        return
    shown = " ".join(options)
    if world_size < 2:
        raise ConfigurationError(
            f"fsdp={shown!r} with {world_size} process: sharding needs at least 2 ranks; launch "
            "more processes (torchrun / trainer-runtime launch) or leave fsdp unset"
        )
    config = args.fsdp_config or FsdpConfigArguments()
    if ("offload" in options or config.cpu_offload) and not cuda:
        field = "fsdp='... offload'" if "offload" in options else "fsdp_config.cpu_offload=True"
        raise ConfigurationError(
            f"{field} needs CUDA devices (it moves GPU parameters to host memory); this run "
            "trains on CPU, where they already live in host memory: remove the offload option"
        )
    if getattr(args, "ddp_backend", None) == "nccl" and not cuda:
        raise ConfigurationError(
            f"fsdp={shown!r} with ddp_backend='nccl' needs CUDA devices: use ddp_backend='gloo' "
            "on CPU (or leave it unset)"
        )
    if (getattr(args, "fp16", False) or getattr(args, "bf16", False)) and not cuda:
        raise ConfigurationError(
            f"fsdp={shown!r} with bf16/fp16 on CPU: reduced-precision sharded training is not "
            "validated on gloo in this runtime; train in fp32 on CPU (bf16=False, fp16=False)"
        )
    if getattr(args, "save_on_each_node", False):
        raise ConfigurationError(
            f"fsdp={shown!r} with save_on_each_node=True: every rank writes its own shards of one "
            "checkpoint, so output_dir must be storage all nodes share; set "
            "save_on_each_node=False"
        )
    if user_optimizer:
        raise ConfigurationError(
            f"fsdp={shown!r} with optimizers=(optimizer, ...): an optimizer built before "
            "sharding holds the unsharded parameters; let the Trainer build it (optim, "
            "learning_rate, ...) or override create_optimizer()"
        )
    if getattr(args, "torch_compile", False):
        raise ConfigurationError(
            f"fsdp={shown!r} with torch_compile=True is not supported in this runtime: set "
            "torch_compile=False"
        )
