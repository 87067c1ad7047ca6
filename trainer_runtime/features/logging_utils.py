"""Logging decisions and metric output of the Trainer (torch-free).

* when to log: ``logging_strategy`` ("no", "steps", "epoch"), ``logging_steps`` (a step count or
  a ratio < 1 of the total steps), ``logging_first_step``;
* the logged training loss: mean over the steps since the last log, with
  ``logging_nan_inf_filter`` replacing NaN/Inf step losses by the mean of the valid ones (logging
  only: gradients are not affected);
* ``include_num_input_tokens_seen`` ("all", "non_padding", "no", or a bool);
* process log levels (``log_level``, ``log_level_replica``, ``log_on_each_node``);
* ``metrics_format`` / ``log_metrics`` / ``save_metrics``, which the Trainer methods of the same
  names delegate to.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import ConfigurationError

__all__ = [
    "LOG_LEVELS",
    "TrainLossTracker",
    "apply_log_level",
    "count_input_tokens",
    "log_metrics",
    "metrics_format",
    "normalize_tokens_seen_mode",
    "process_log_level",
    "resolve_interval",
    "save_metrics",
    "should_log_at_epoch_end",
    "should_log_at_step",
    "speed_metrics",
    "validate_interval",
]

TokensSeenMode = Literal["all", "non_padding", "no"]

# "passive" keeps whatever level the application configured.
LOG_LEVELS: dict[str, int | None] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "passive": None,
}


def validate_interval(name: str, value: float) -> float | int:
    """A ``*_steps`` value: a whole step count >= 1, or a ratio in (0, 1) of the total steps."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigurationError(f"{name}={value!r} must be a number")
    if value <= 0:
        raise ConfigurationError(
            f"{name}={value!r} must be > 0: a step count (e.g. 500) or a ratio in (0, 1) of the "
            "total steps (e.g. 0.1)"
        )
    if value >= 1:
        if value != int(value):
            raise ConfigurationError(
                f"{name}={value!r} is neither a whole step count nor a ratio below 1: use "
                f"{int(value)} or a value in (0, 1)"
            )
        return int(value)
    return float(value)


def resolve_interval(value: float, max_steps: int) -> int:
    """Steps between two events: ratios are ``ceil(ratio * max_steps)`` (at least 1)."""
    if value >= 1:
        return int(value)
    if max_steps <= 0:
        raise ConfigurationError(
            f"a ratio interval ({value}) needs a known number of total steps: set max_steps"
        )
    return max(1, math.ceil(value * max_steps))


def should_log_at_step(
    logging_strategy: str, global_step: int, logging_steps: int, logging_first_step: bool
) -> bool:
    """Log at the end of this optimizer step? (``logging_steps`` already resolved to steps.)"""
    if global_step == 1 and logging_first_step:
        return True
    return logging_strategy == "steps" and logging_steps > 0 and global_step % logging_steps == 0


def should_log_at_epoch_end(logging_strategy: str) -> bool:
    return logging_strategy == "epoch"


class TrainLossTracker:
    """Sums step losses between two logs and returns their mean when a log is written.

    With ``nan_inf_filter`` a NaN/Inf step loss is replaced by the mean of the valid ones since the
    last log (nothing logged is NaN unless every step was); ``filtered`` counts replacements.
    """

    def __init__(self, nan_inf_filter: bool = True) -> None:
        self.nan_inf_filter = nan_inf_filter
        self._sum = 0.0
        self._valid = 0
        self._steps = 0
        self.filtered = 0
        self.total = 0.0  # sum over the whole run (for the final train_loss)
        self.total_steps = 0

    def add(self, step_loss: float) -> None:
        step_loss = float(step_loss)
        self._steps += 1
        self.total_steps += 1
        if self.nan_inf_filter and not math.isfinite(step_loss):
            self.filtered += 1
            return
        self._sum += step_loss
        self._valid += 1

    def pop_mean(self) -> float | None:
        """Mean loss per step since the last call (None when no step was added)."""
        if self._steps == 0:
            return None
        if self.nan_inf_filter:
            mean = self._sum / self._valid if self._valid else float("nan")
        else:
            mean = self._sum / self._steps
        self.total += mean * self._steps
        self._sum, self._valid, self._steps = 0.0, 0, 0
        return mean

    @property
    def run_mean(self) -> float | None:
        pending = self._steps
        if self.total_steps == 0:
            return None
        extra = 0.0
        if pending:
            valid_mean = self._sum / self._valid if self._valid else float("nan")
            extra = (valid_mean if self.nan_inf_filter else self._sum / pending) * pending
        return (self.total + extra) / self.total_steps


def normalize_tokens_seen_mode(value: str | bool | None) -> TokensSeenMode:
    """``include_num_input_tokens_seen``: True -> "all", False/None -> "no"."""
    if value is True:
        return "all"
    if value is False or value is None:
        return "no"
    if value in ("all", "non_padding", "no"):
        return value  # type: ignore[return-value]
    raise ConfigurationError(
        f"include_num_input_tokens_seen={value!r} must be 'all', 'non_padding', 'no' or a bool"
    )


def count_input_tokens(
    inputs: Mapping[str, Any],
    mode: TokensSeenMode,
    *,
    main_input_name: str = "input_ids",
    pad_token_id: int | None = None,
) -> int:
    """Input tokens of one micro-batch: every position ("all") or only real tokens
    ("non_padding": the attention mask, else ``!= pad_token_id``, else every position)."""
    if mode == "no":
        return 0
    if main_input_name not in inputs:
        raise ConfigurationError(
            f"include_num_input_tokens_seen={mode!r} counts {main_input_name!r}, which the batch "
            f"does not have (keys: {sorted(inputs)})"
        )
    ids = inputs[main_input_name]
    if mode == "non_padding":
        mask = inputs.get("attention_mask")
        if mask is not None:
            return int(mask.sum())
        if pad_token_id is not None:
            return int((ids != pad_token_id).sum())
        logging.getLogger(__name__).warning(
            "include_num_input_tokens_seen='non_padding' without attention_mask or pad_token_id: "
            "counting every position"
        )
    return int(ids.numel())


def process_log_level(
    log_level: str,
    log_level_replica: str,
    *,
    process_index: int,
    local_process_index: int,
    log_on_each_node: bool,
    current_level: int | None = None,
) -> int | None:
    """Level for this process: ``log_level`` on the main process (of each node when
    ``log_on_each_node``), ``log_level_replica`` elsewhere. "passive" returns ``current_level``
    (None by default: leave the application's logging configuration alone)."""
    for name, value in (("log_level", log_level), ("log_level_replica", log_level_replica)):
        if value not in LOG_LEVELS:
            raise ConfigurationError(f"{name}={value!r} must be one of {', '.join(LOG_LEVELS)}")
    is_main = local_process_index == 0 if log_on_each_node else process_index == 0
    chosen = LOG_LEVELS[log_level if is_main else log_level_replica]
    return current_level if chosen is None else chosen


def apply_log_level(level: int, loggers: tuple[str, ...] = ("trainer_runtime",)) -> None:
    for name in loggers:
        logging.getLogger(name).setLevel(level)


def speed_metrics(
    split: str,
    start_time: float,
    *,
    num_samples: int | None = None,
    num_steps: int | None = None,
    num_tokens: int | None = None,
    now: Callable[[], float] = time.time,
) -> dict[str, float]:
    """``<split>_runtime`` and per-second rates (samples, steps, tokens) since ``start_time``."""
    runtime = now() - start_time
    out: dict[str, float] = {f"{split}_runtime": round(runtime, 4)}
    if runtime <= 0:
        return out
    if num_samples is not None:
        out[f"{split}_samples_per_second"] = round(num_samples / runtime, 3)
    if num_steps is not None:
        out[f"{split}_steps_per_second"] = round(num_steps / runtime, 3)
    if num_tokens is not None:
        out[f"{split}_tokens_per_second"] = round(num_tokens / runtime, 3)
    return out


def _format_runtime(seconds: float) -> str:
    # h:mm:ss.cc, e.g. 0:01:05.25
    whole = int(seconds)
    centis = int(abs(seconds - whole) * 100)
    return f"{datetime.timedelta(seconds=whole)}.{centis:02d}"


def metrics_format(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Human-readable values: memory in MB, runtimes as h:mm:ss.cc, FLOs in GF, floats rounded
    to 4 decimals. Other values are unchanged."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if "_mem_" in key and isinstance(value, (int, float)):
            out[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key and isinstance(value, (int, float)):
            out[key] = _format_runtime(float(value))
        elif key == "total_flos" and isinstance(value, (int, float)):
            out[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            out[key] = round(value, 4)
        else:
            out[key] = value
    return out


def log_metrics(
    split: str,
    metrics: Mapping[str, Any],
    *,
    is_world_process_zero: bool = True,
    print_fn: Callable[[str], None] = print,
) -> None:
    """Print ``***** <split> metrics *****`` and one aligned ``key = value`` line per metric,
    sorted by key (rank 0 only)."""
    if not is_world_process_zero:
        return
    formatted = metrics_format(metrics)
    print_fn(f"***** {split} metrics *****")
    if not formatted:
        return
    key_width = max(len(k) for k in formatted)
    value_width = max(len(str(v)) for v in formatted.values())
    for key in sorted(formatted):
        print_fn(f"  {key: <{key_width}} = {formatted[key]!s:>{value_width}}")


def save_metrics(
    split: str,
    metrics: Mapping[str, Any],
    output_dir: str,
    *,
    combined: bool = True,
    is_world_process_zero: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> str | None:
    """Write the raw metrics to ``<split>_results.json`` under ``output_dir`` and, when
    ``combined``, merge them into ``all_results.json``. Returns the file written (rank 0)."""
    if not is_world_process_zero:
        return None
    storage = Storage(output_dir, storage_options)
    storage.makedirs()
    name = "all_results.json" if split == "all" else f"{split}_results.json"
    storage.atomic_write_json(name, dict(metrics))
    if combined and split != "all":
        merged: dict[str, Any] = {}
        if storage.exists("all_results.json"):
            merged = dict(storage.read_json("all_results.json"))
        merged.update(metrics)
        storage.atomic_write_json("all_results.json", merged)
    return storage.join(name)
