"""TrainingArguments: Hugging Face names and defaults, validated by pydantic at construction.

Fields are grouped by concern; to add one, put it in its group with a ``description`` (that is its
documentation) and, when it depends on other fields, check it in ``_cross_checks``. Field groups of
their own live in mixins this class inherits: the dataloader/data fields in
:class:`trainer_runtime.data.arguments.DataArguments`, the distributed fields (ddp_*,
average_tokens_across_devices, accelerator_config, save_on_each_node) in
:class:`trainer_runtime.distributed.ddp_args.DdpArguments`, the FSDP fields (fsdp, fsdp_config) in
:class:`trainer_runtime.distributed.fsdp_args.FsdpArguments`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainer_runtime.data.arguments import ALL_SAMPLING_STRATEGIES, DataArguments
from trainer_runtime.distributed.ddp_args import DdpArguments
from trainer_runtime.distributed.fsdp_args import FsdpArguments
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.arguments import FeatureArguments
from trainer_runtime.protocol import ENV_OUTPUT_DIR

__all__ = ["SAMPLING_STRATEGIES", "TrainingArguments"]

# Batch orders the trainer can build (trainer_runtime.data.samplers and length_sampling).
SAMPLING_STRATEGIES: tuple[str, ...] = ALL_SAMPLING_STRATEGIES


def _default_output_dir() -> str | None:
    return os.environ.get(ENV_OUTPUT_DIR) or None


def _default_jit() -> bool:
    # Under the operator (which sets the output dir) preemption is expected: save on SIGTERM.
    return bool(os.environ.get(ENV_OUTPUT_DIR))


def _steps_or_ratio(name: str, value: float) -> float:
    """Values >= 1 are step counts (must be whole), values in (0, 1) ratios of the total steps."""
    if value <= 0:
        raise ValueError("must be > 0 (a step count, or a ratio in (0, 1) of the total steps)")
    if value >= 1 and value != int(value):
        raise ValueError(f"{value} is neither a whole step count nor a ratio below 1")
    return int(value) if value >= 1 else value


class TrainingArguments(FeatureArguments, DataArguments, DdpArguments, FsdpArguments):
    """Arguments of :class:`trainer_runtime.Trainer` (Hugging Face names and defaults).

    Invalid values raise :class:`trainer_runtime.errors.ConfigurationError` naming the field, the
    value and the fix. Assignments after construction are validated too.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    # -- where checkpoints go ----------------------------------------------------------------------
    output_dir: str | None = Field(
        default_factory=_default_output_dir,
        description="Directory or fsspec URL of the checkpoints. Default: $PREEMPTIBLE_OUTPUT_DIR; "
        "required when that is not set.",
    )

    # -- batch and duration ------------------------------------------------------------------------
    per_device_train_batch_size: int = Field(
        8, ge=1, description="Samples per micro-batch on each device."
    )
    gradient_accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches accumulated into one optimizer step."
    )
    num_train_epochs: float = Field(
        3.0, gt=0, description="Epochs to train (fractional allowed); ignored when max_steps > 0."
    )
    max_steps: int = Field(
        -1,
        description="Total optimizer steps; overrides num_train_epochs when > 0. -1: from epochs. "
        "Required (> 0) for iterable datasets.",
    )

    # -- optimizer ---------------------------------------------------------------------------------
    optim: Literal["adamw_torch", "adamw_torch_fused", "sgd"] = Field(
        "adamw_torch_fused", description="Optimizer."
    )
    learning_rate: float = Field(5e-5, ge=0, description="Initial (peak) learning rate.")
    weight_decay: float = Field(
        0.0, ge=0, description="Weight decay; never applied to biases and norm weights."
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(
        1.0, ge=0, description="Gradient clipping norm; 0 disables clipping."
    )

    # -- learning-rate schedule ------------------------------------------------------------------
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
    ] = Field("linear", description="Learning-rate schedule.")
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra schedule arguments (cosine: num_cycles; polynomial: lr_end, power); "
        "a dict or a JSON string.",
    )
    warmup_steps: float = Field(
        0, ge=0, description="Linear warm-up: a step count (>= 1) or a ratio (< 1) of total steps."
    )

    # -- checkpoints -------------------------------------------------------------------------------
    # save_strategy (with "best"), report_to and the evaluation / logging / best-model / precision
    # fields come from FeatureArguments (trainer_runtime.features.arguments).
    save_steps: float = Field(
        500,
        description="Save every N optimizer steps (save_strategy='steps'); a value < 1 is a ratio "
        "of the total steps.",
    )
    save_total_limit: int | None = Field(
        None,
        ge=1,
        description="Keep at most this many checkpoints (oldest removed after a new one is "
        "complete; the newest complete one is never removed).",
    )
    save_only_model: bool = Field(
        False,
        description="Save only the weights and trainer state: smaller, but a resumed run restarts "
        "the optimizer and RNG (not bit-identical).",
    )
    enable_jit_checkpoint: bool = Field(
        default_factory=_default_jit,
        description="On SIGTERM, finish the optimizer step in flight, save a checkpoint and stop. "
        "Default: True when $PREEMPTIBLE_OUTPUT_DIR is set, else False.",
    )
    ignore_data_skip: bool = Field(
        False,
        description="On resume, do not restore the data position (start the epoch over instead of "
        "skipping to where the checkpoint was).",
    )

    # -- data (dataloader fields: DataArguments) ---------------------------------------------------
    label_names: list[str] | None = Field(
        None, description="Batch keys holding labels. Default: ['labels']."
    )

    # -- reproducibility ---------------------------------------------------------------------------
    seed: int = Field(
        42, ge=0, description="Seed set at Trainer construction (python/numpy/torch)."
    )
    data_seed: int | None = Field(None, ge=0, description="Seed of the data order; default: seed.")
    full_determinism: bool = Field(
        False,
        description="Also call torch.use_deterministic_algorithms(True), and keep DDP's gradient "
        "bucket order fixed (find_unused_parameters=True unless set) so a resumed run is "
        "bit-identical with any number of ranks (slower).",
    )

    # -- hardware ----------------------------------------------------------------------------------
    use_cpu: bool = Field(False, description="Train on CPU even when an accelerator is available.")

    # -- logging -----------------------------------------------------------------------------------
    logging_strategy: Literal["no", "steps", "epoch"] = Field(
        "steps", description="When to log loss and learning rate."
    )
    logging_steps: float = Field(
        500, description="Log every N optimizer steps; a value < 1 is a ratio of the total steps."
    )
    logging_first_step: bool = Field(False, description="Also log after the first step.")

    # -- validators --------------------------------------------------------------------------------
    @field_validator("save_steps", "logging_steps")
    @classmethod
    def _check_steps(cls, value: float, info: Any) -> float:
        return _steps_or_ratio(info.field_name, value)

    @field_validator("warmup_steps")
    @classmethod
    def _check_warmup(cls, value: float) -> float:
        if value >= 1 and value != int(value):
            raise ValueError(f"{value} is neither a whole step count nor a ratio below 1")
        return int(value) if value >= 1 else value

    @field_validator("max_steps")
    @classmethod
    def _check_max_steps(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be a positive step count, or -1 to train num_train_epochs")
        return value

    @field_validator("lr_scheduler_kwargs", mode="before")
    @classmethod
    def _parse_kwargs(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, str):
            try:
                return json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object ({exc})") from exc
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> TrainingArguments:
        if not self.output_dir:
            raise ValueError(
                "output_dir is required: pass output_dir='...' (a path or fsspec URL) or set "
                f"${ENV_OUTPUT_DIR}"
            )
        return self

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigurationError(_format_errors(exc, data, type(self))) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            raise ConfigurationError(_format_errors(exc, {name: value}, type(self))) from None

    # -- derived values ----------------------------------------------------------------------------
    @property
    def train_batch_size(self) -> int:
        """Micro-batch size per device (Hugging Face name)."""
        return self.per_device_train_batch_size

    def steps_from_ratio(self, value: float, max_steps: int) -> int:
        """Resolve a save/logging interval that may be a ratio of ``max_steps``."""
        return int(value) if value >= 1 else max(1, math.ceil(value * max_steps))

    def to_json_string(self) -> str:
        return self.model_dump_json(indent=2)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _format_errors(exc: ValidationError, data: dict[str, Any], model: type[BaseModel]) -> str:
    lines = [f"invalid TrainingArguments ({exc.error_count()} error(s)):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "output_dir"
        if err["type"] == "extra_forbidden":
            known = _nested_fields(model, err["loc"][:-1])
            close = difflib.get_close_matches(str(err["loc"][-1]), known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "remove it"
            what = "argument" if len(err["loc"]) == 1 else "key"
            lines.append(f"  - {loc}: unknown {what}; {hint}")
            continue
        field = model.model_fields.get(str(err["loc"][0])) if err["loc"] else None
        value = data.get(str(err["loc"][0]), err.get("input")) if err["loc"] else None
        msg = err["msg"].removeprefix("Value error, ")
        desc = f" ({field.description})" if field is not None and field.description else ""
        if err["loc"]:
            lines.append(f"  - {loc}={value!r}: {msg}{desc}")
        else:
            lines.append(f"  - {msg}")
    return "\n".join(lines)


def _nested_fields(model: type[BaseModel], path: tuple[Any, ...]) -> list[str]:
    """Field names of the (nested) model at ``path``, e.g. ("fsdp_config",) -> its keys."""
    current: Any = model
    for part in path:
        field = current.model_fields.get(str(part)) if isinstance(current, type) else None
        if field is None:
            return []
        candidates = [field.annotation, *getattr(field.annotation, "__args__", ())]
        current = next(
            (c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None
        )
        if current is None:
            return []
    return list(current.model_fields)
