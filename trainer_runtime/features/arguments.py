"""Evaluation, logging, best-model and precision arguments as one pydantic field group.

:class:`FeatureArguments` is meant to be a base class of ``TrainingArguments``
(``class TrainingArguments(FeatureArguments)``): its fields carry Hugging Face names and defaults,
and its validator checks the cross-field rules of the reference docs up front. It reads the
core fields it depends on (``save_steps``, ``logging_steps``) from the final class when present.
Torch-free, like ``training_args``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainer_runtime.features.best import (
    default_greater_is_better,
    resolve_metric_for_best_model,
    validate_best_model_settings,
)
from trainer_runtime.features.logging_utils import LOG_LEVELS, normalize_tokens_seen_mode
from trainer_runtime.features.trackers import normalize_report_to

__all__ = ["COMPILE_MODES", "FeatureArguments"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

LogLevel = Literal["debug", "info", "warning", "error", "critical", "passive"]
assert set(LogLevel.__args__) == set(LOG_LEVELS)  # type: ignore[attr-defined]


def _json_dict(value: Any) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a JSON object ({exc})") from exc
    return value


def _set(model: BaseModel, name: str, value: Any) -> None:
    # Derived defaults are written without re-running validation (validate_assignment would
    # recurse into the model validator).
    model.__dict__[name] = value


class FeatureArguments(BaseModel):
    """Evaluation / logging / best-model / precision fields of ``TrainingArguments``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)

    # -- evaluation ------------------------------------------------------------------------------
    eval_strategy: Literal["no", "steps", "epoch"] = Field(
        "no", description="When to evaluate during training: never, every eval_steps, each epoch."
    )
    eval_steps: float | None = Field(
        None,
        description="Evaluate every N optimizer steps (eval_strategy='steps'); a value < 1 is a "
        "ratio of the total steps. Default: logging_steps.",
    )
    eval_delay: float = Field(
        0, ge=0, description="Epochs or steps (per eval_strategy) before the first evaluation."
    )
    per_device_eval_batch_size: int = Field(8, ge=1, description="Evaluation batch size.")
    prediction_loss_only: bool = Field(
        False, description="Evaluation and prediction return only the loss."
    )
    eval_on_start: bool = Field(
        False, description="Run a full evaluation before the first training step (sanity check)."
    )
    eval_do_concat_batches: bool = Field(
        True, description="Concatenate predictions across batches; False keeps a list of batches."
    )
    eval_accumulation_steps: int | None = Field(
        None,
        ge=1,
        description="Move accumulated predictions to the CPU every N evaluation batches. "
        "Unset: keep everything on the device until the end (faster, more device memory).",
    )
    include_for_metrics: list[str] = Field(
        default_factory=list,
        description="Extra EvalPrediction fields for compute_metrics: 'inputs', 'loss'.",
    )
    batch_eval_metrics: bool = Field(
        False,
        description="Call compute_metrics(eval_pred, compute_result) on every batch instead of "
        "keeping all logits; compute_result=True on the last batch.",
    )

    # -- logging ---------------------------------------------------------------------------------
    logging_nan_inf_filter: bool = Field(
        True,
        description="Replace NaN/Inf training losses by the mean of the valid ones in logs, and "
        "leave NaN/Inf batches out of the evaluation loss (logging only).",
    )
    include_num_input_tokens_seen: str | bool = Field(
        "no",
        description="Track input tokens seen: 'all', 'non_padding', 'no' (True = 'all').",
    )
    log_level: LogLevel = Field(
        "passive", description="Log level of the main process; 'passive' leaves it unchanged."
    )
    log_level_replica: LogLevel = Field("warning", description="Log level of the other processes.")
    log_on_each_node: bool = Field(
        True, description="Multi-node: the main process of each node logs at log_level."
    )
    disable_tqdm: bool | None = Field(
        None,
        description="Hide progress bars. Default: hidden only when the log level is above warning.",
    )
    report_to: str | list[str] | None = Field(
        "none",
        description="Experiment trackers: 'none', 'all' (every installed one), or names among "
        "tensorboard, trackio, wandb, mlflow.",
    )
    run_name: str | None = Field(None, description="Run name shown by the trackers.")
    project: str = Field("huggingface", description="Project name for the trackers (Trackio).")

    # -- best model ------------------------------------------------------------------------------
    save_strategy: Literal["no", "steps", "epoch", "best"] = Field(
        "steps",
        description="When to save checkpoints: never, every save_steps, each epoch, or whenever "
        "metric_for_best_model improves ('best').",
    )
    load_best_model_at_end: bool = Field(
        False,
        description="Load the best checkpoint at the end of training (needs evaluation; "
        "save_strategy must match eval_strategy unless it is 'best').",
    )
    metric_for_best_model: str | None = Field(
        None,
        description="Evaluation metric that picks the best model, with or without 'eval_'. "
        "Default 'loss' when load_best_model_at_end or save_strategy='best'.",
    )
    greater_is_better: bool | None = Field(
        None,
        description="Whether a larger metric is better. Default: False for names ending in "
        "'loss', True otherwise.",
    )

    # -- precision and speed ---------------------------------------------------------------------
    bf16: bool = Field(False, description="bfloat16 mixed precision (autocast); works on CPU.")
    fp16: bool = Field(False, description="float16 mixed precision (autocast); needs CUDA.")
    bf16_full_eval: bool = Field(False, description="Evaluate with the model cast to bfloat16.")
    fp16_full_eval: bool = Field(False, description="Evaluate with the model cast to float16.")
    tf32: bool | None = Field(
        None, description="TensorFloat-32 matmuls (Ampere+ GPUs); unset: PyTorch's default."
    )
    activation_checkpointing: bool | None = Field(
        None,
        description="Recompute activations in the backward pass to save memory (model must "
        "expose gradient_checkpointing_enable or activation_checkpointing_enable).",
    )
    activation_checkpointing_kwargs: dict[str, Any] | None = Field(
        None, description="Passed to the model's checkpointing method (dict or JSON string)."
    )
    gradient_checkpointing: bool | None = Field(
        None, description="Deprecated alias of activation_checkpointing."
    )
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None, description="Deprecated alias of activation_checkpointing_kwargs."
    )
    torch_compile: bool = Field(False, description="torch.compile the model.")
    torch_compile_backend: str | None = Field(
        None, description="torch.compile backend (setting it turns torch_compile on)."
    )
    torch_compile_mode: str | None = Field(
        None,
        description=f"torch.compile mode, one of {', '.join(COMPILE_MODES)} (setting it turns "
        "torch_compile on).",
    )
    torch_empty_cache_steps: int | None = Field(
        None, ge=1, description="Empty the device cache every N steps (unset: never)."
    )
    label_smoothing_factor: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Label smoothing epsilon: targets become eps/C and 1 - eps + eps/C.",
    )

    # -- field checks ----------------------------------------------------------------------------
    @field_validator("eval_steps")
    @classmethod
    def _check_eval_steps(cls, value: float | None) -> float | None:
        if value is None:
            return None
        if math.isnan(value) or value <= 0:
            raise ValueError("must be > 0 (a step count, or a ratio in (0, 1) of the total steps)")
        if value >= 1 and value != int(value):
            raise ValueError(f"{value} is neither a whole step count nor a ratio below 1")
        return int(value) if value >= 1 else value

    @field_validator("include_for_metrics")
    @classmethod
    def _check_include(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - {"inputs", "loss"})
        if unknown:
            raise ValueError(f"unknown entries {unknown}; allowed: 'inputs', 'loss'")
        return value

    @field_validator("include_num_input_tokens_seen")
    @classmethod
    def _check_tokens_seen(cls, value: str | bool) -> str:
        return normalize_tokens_seen_mode(value)

    # Same name as the core class's validator so that, merged, this one replaces it.
    @field_validator("report_to", mode="before")
    @classmethod
    def _check_report_to(cls, value: Any) -> Any:
        names = normalize_report_to(value)
        return names or "none"

    @field_validator(
        "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs", mode="before"
    )
    @classmethod
    def _parse_ckpt_kwargs(cls, value: Any) -> Any:
        return _json_dict(value)

    @field_validator("torch_compile_mode")
    @classmethod
    def _check_compile_mode(cls, value: str | None) -> str | None:
        if value is not None and value not in COMPILE_MODES:
            raise ValueError(f"use one of {', '.join(COMPILE_MODES)}")
        return value

    # -- cross-field checks ----------------------------------------------------------------------
    @model_validator(mode="after")
    def _feature_checks(self) -> FeatureArguments:
        if self.bf16 and self.fp16:
            raise ValueError("bf16=True and fp16=True are exclusive: pick one")
        if self.bf16_full_eval and self.fp16_full_eval:
            raise ValueError("bf16_full_eval=True and fp16_full_eval=True are exclusive")
        if self.eval_on_start and self.eval_strategy == "no":
            raise ValueError(
                "eval_on_start=True needs an evaluation strategy: set eval_strategy to 'steps' or "
                "'epoch' (and give the Trainer an eval_dataset)"
            )
        if self.eval_strategy == "steps" and self.eval_steps is None:
            _set(self, "eval_steps", getattr(self, "logging_steps", 500))
        metric = resolve_metric_for_best_model(
            self.metric_for_best_model,
            load_best_model_at_end=self.load_best_model_at_end,
            save_strategy=self.save_strategy,
        )
        if metric != self.metric_for_best_model:
            _set(self, "metric_for_best_model", metric)
        if metric is not None and self.greater_is_better is None:
            _set(self, "greater_is_better", default_greater_is_better(metric))
        validate_best_model_settings(
            load_best_model_at_end=self.load_best_model_at_end,
            eval_strategy=self.eval_strategy,
            save_strategy=self.save_strategy,
            eval_steps=self.eval_steps,
            save_steps=getattr(self, "save_steps", 500),
            metric_for_best_model=metric,
        )
        self._resolve_checkpointing_alias()
        if (self.torch_compile_backend or self.torch_compile_mode) and not self.torch_compile:
            _set(self, "torch_compile", True)
        return self

    def _resolve_checkpointing_alias(self) -> None:
        """Fold the deprecated gradient_checkpointing* aliases into activation_checkpointing*.

        As in transformers, the alias counts only where it differs from the new name, and once
        resolved the alias mirrors the new name (scripts that read it keep working; re-validation
        then sees no alias to warn about). Unset means False. Unlike transformers, an alias that
        contradicts an explicit new value is an error instead of being ignored.
        """
        pairs = (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        )
        given = [
            (old, new)
            for old, new in pairs
            if getattr(self, old) is not None and getattr(self, old) != getattr(self, new)
        ]
        if given:
            import warnings

            warnings.warn(
                "gradient_checkpointing / gradient_checkpointing_kwargs are deprecated aliases: "
                "use activation_checkpointing / activation_checkpointing_kwargs",
                FutureWarning,
                stacklevel=2,
            )
        for old, new in given:
            if getattr(self, new) is not None:
                shown = "" if old.endswith("kwargs") else f"={getattr(self, new)!r}"
                alias = "" if old.endswith("kwargs") else f"={getattr(self, old)!r}"
                raise ValueError(
                    f"{new}{shown} contradicts its deprecated alias {old}{alias}: set only {new}"
                )
            _set(self, new, getattr(self, old))
        if self.activation_checkpointing is None:
            _set(self, "activation_checkpointing", False)
        for old, new in pairs:
            _set(self, old, getattr(self, new))

    # -- derived values --------------------------------------------------------------------------
    @property
    def report_to_list(self) -> list[str]:
        """``report_to`` as a list (empty for none)."""
        return normalize_report_to(self.report_to)
