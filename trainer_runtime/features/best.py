"""Best-model tracking: which metric, which direction, when a checkpoint is the new best, which
checkpoints rotation may delete. Pure functions (torch-free) the Trainer calls.

Semantics from the reference docs:

* ``metric_for_best_model`` is a name returned by evaluation, with or without the ``eval_``
  prefix; default ``"loss"``. ``greater_is_better`` defaults to ``True`` unless the name ends
  with ``"loss"``.
* ``save_strategy="best"`` saves a checkpoint only when the metric improves, and keeps only the
  single best one (earlier bests are stale and rotated away).
* ``load_best_model_at_end`` needs an evaluation strategy; ``save_strategy`` must equal
  ``eval_strategy`` unless it is ``"best"``; with ``"steps"``, ``save_steps`` must be a multiple of
  ``eval_steps``.
* ``save_total_limit`` with ``load_best_model_at_end``: the best checkpoint is always kept, plus the
  most recent ones (``save_total_limit=5`` keeps the 4 most recent and the best).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

from trainer_runtime.errors import ConfigurationError

__all__ = [
    "DEFAULT_METRIC",
    "best_rotation_victims",
    "default_greater_is_better",
    "is_better",
    "metric_key",
    "resolve_metric_for_best_model",
    "update_best",
    "validate_best_model_settings",
]

DEFAULT_METRIC = "loss"


def resolve_metric_for_best_model(
    metric_for_best_model: str | None,
    *,
    load_best_model_at_end: bool = False,
    save_strategy: str = "steps",
) -> str | None:
    """The metric name in force: the user's, or ``"loss"`` when best tracking is on."""
    if metric_for_best_model:
        return metric_for_best_model
    if load_best_model_at_end or save_strategy == "best":
        return DEFAULT_METRIC
    return None


def metric_key(metric_for_best_model: str, prefix: str = "eval") -> str:
    """The key in evaluation metrics: ``"accuracy"`` -> ``"eval_accuracy"``; prefixed names stay."""
    if metric_for_best_model.startswith(f"{prefix}_"):
        return metric_for_best_model
    return f"{prefix}_{metric_for_best_model}"


def default_greater_is_better(metric_for_best_model: str | None) -> bool:
    """``False`` for names ending in ``"loss"`` (and for the default metric), ``True`` otherwise."""
    name = metric_for_best_model or DEFAULT_METRIC
    return not name.endswith("loss")


def is_better(value: float, best: float | None, greater_is_better: bool) -> bool:
    """Strict improvement; the first value is always the best. NaN never improves."""
    if math.isnan(value):
        return False
    if best is None or math.isnan(best):
        return True
    return value > best if greater_is_better else value < best


def update_best(
    metrics: Mapping[str, float],
    *,
    best_metric: float | None,
    metric_for_best_model: str,
    greater_is_better: bool | None = None,
    prefix: str = "eval",
) -> tuple[bool, float | None]:
    """Compare the metric of one evaluation with the best so far.

    Returns ``(is_new_best, best_metric_after)``. A missing metric is an error naming the
    available keys (the typical mistake: ``compute_metrics`` does not return that name).
    """
    key = metric_key(metric_for_best_model, prefix)
    if key not in metrics:
        raise ConfigurationError(
            f"metric_for_best_model={metric_for_best_model!r}: evaluation returned no {key!r} "
            f"(it returned {sorted(metrics)}); make compute_metrics return "
            f"{key.removeprefix(prefix + '_')!r} or pick one of those names"
        )
    value = float(metrics[key])
    if greater_is_better is None:
        greater_is_better = default_greater_is_better(metric_for_best_model)
    if is_better(value, best_metric, greater_is_better):
        return True, value
    return False, best_metric


def _is_multiple(save_steps: float, eval_steps: float) -> bool:
    if save_steps >= 1 and eval_steps >= 1:
        return int(save_steps) % int(eval_steps) == 0
    if save_steps < 1 and eval_steps < 1:
        ratio = save_steps / eval_steps
        return math.isclose(ratio, round(ratio), rel_tol=0, abs_tol=1e-9) and round(ratio) >= 1
    return False


def validate_best_model_settings(
    *,
    load_best_model_at_end: bool,
    eval_strategy: str,
    save_strategy: str,
    eval_steps: float | None,
    save_steps: float,
    metric_for_best_model: str | None,
) -> None:
    """Reject combinations that cannot work, up front, with the field names and the fix."""
    if save_strategy == "best" and eval_strategy == "no":
        raise ConfigurationError(
            "save_strategy='best' saves when an evaluation improves metric_for_best_model, but "
            "eval_strategy='no' never evaluates: set eval_strategy to 'steps' or 'epoch'"
        )
    if not load_best_model_at_end:
        return
    if eval_strategy == "no":
        raise ConfigurationError(
            "load_best_model_at_end=True needs evaluations to pick the best model, but "
            "eval_strategy='no': set eval_strategy to 'steps' or 'epoch'"
        )
    if save_strategy == "best":
        return
    if save_strategy != eval_strategy:
        raise ConfigurationError(
            f"load_best_model_at_end=True requires save_strategy to match eval_strategy (or be "
            f"'best'), got save_strategy={save_strategy!r} and eval_strategy={eval_strategy!r}: "
            f"set save_strategy={eval_strategy!r}"
        )
    if save_strategy == "steps":
        steps = eval_steps if eval_steps is not None else save_steps
        if not _is_multiple(save_steps, steps):
            raise ConfigurationError(
                f"load_best_model_at_end=True requires save_steps to be a multiple of eval_steps "
                f"(both absolute or both ratios), got save_steps={save_steps!r} and "
                f"eval_steps={steps!r}: e.g. set save_steps={steps!r}"
            )
    del metric_for_best_model  # any name is valid here; update_best checks it against metrics


def best_rotation_victims(
    checkpoints: Sequence[str],
    *,
    save_total_limit: int | None,
    best_checkpoint: str | None = None,
    save_strategy: str = "steps",
    protect: Collection[str] = (),
) -> list[str]:
    """Checkpoints to delete, oldest first. ``checkpoints`` are complete ones, oldest first.

    Never deleted: the newest checkpoint (needed to resume), the best checkpoint, anything in
    ``protect``. With ``save_strategy="best"`` every earlier best is stale and deleted (only the
    single best is kept, plus a newer checkpoint such as a JIT one). Otherwise ``save_total_limit``
    counts the best among the kept ones: the best and the ``limit - 1`` most recent; with a limit
    of 1 and a best that is not the newest, both are kept.
    """
    if not checkpoints:
        return []
    newest = checkpoints[-1]
    keep = {newest, *protect}
    if best_checkpoint is not None:
        keep.add(best_checkpoint)
    if save_strategy == "best" and best_checkpoint is not None:
        return [c for c in checkpoints if c not in keep]
    if save_total_limit is None:
        return []
    if save_total_limit < 1:
        raise ConfigurationError(
            f"save_total_limit={save_total_limit!r} must be >= 1 (or None to keep every checkpoint)"
        )
    recent = list(checkpoints[-save_total_limit:])
    if best_checkpoint is not None and best_checkpoint not in recent:
        # The best takes one of the slots, but the newest is never given up.
        recent = list(checkpoints[-max(1, save_total_limit - 1) :])
    keep.update(recent)
    return [c for c in checkpoints if c not in keep]
