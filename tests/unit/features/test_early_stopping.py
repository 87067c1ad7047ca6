from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.best import update_best
from trainer_runtime.features.early_stopping import EarlyStoppingCallback
from trainer_runtime.state import TrainerControl, TrainerState


def _args(**kw):
    base = dict(
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=None,
        eval_strategy="steps",
    )
    base.update(kw)
    return SimpleNamespace(**base)


def run_evals(values, *, patience, threshold=0.0, metric="loss", greater=None):
    """Drive the callback as the Trainer does: on_evaluate, then the best-metric update."""
    args = _args(metric_for_best_model=metric, greater_is_better=greater)
    cb = EarlyStoppingCallback(patience, threshold)
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control)
    for i, value in enumerate(values):
        metrics = {f"eval_{metric.removeprefix('eval_')}": value}
        cb.on_evaluate(args, state, control, metrics=metrics)
        _, state.best_metric = update_best(
            metrics,
            best_metric=state.best_metric,
            metric_for_best_model=metric,
            greater_is_better=greater,
        )
        if control.should_training_stop:
            return i, cb
    return None, cb


@pytest.mark.parametrize(
    ("values", "patience", "threshold", "metric", "stop_at"),
    [
        ([1.0, 0.9, 0.95, 0.92, 0.91], 2, 0.0, "loss", 3),
        ([1.0, 0.9, 0.95, 0.85, 0.91, 0.99], 2, 0.0, "loss", 5),  # improvement resets the count
        ([1.0, 0.9, 0.95], 1, 0.0, "eval_loss", 2),
        ([1.0, 0.97, 0.9, 0.89], 2, 0.05, "loss", None),  # 0.97 too small a gain, 0.9 enough
        ([1.0, 0.98, 0.96, 0.94], 3, 0.05, "loss", 3),
        ([0.5, 0.6, 0.6, 0.55], 2, 0.0, "accuracy", 3),  # greater is better by default
    ],
)
def test_early_stopping_semantics(values, patience, threshold, metric, stop_at):
    stopped, _ = run_evals(values, patience=patience, threshold=threshold, metric=metric)
    assert stopped == stop_at


def test_greater_is_better_override():
    # 'score' would default to greater-is-better; here lower is better
    stopped, _ = run_evals([3.0, 2.0, 2.5, 2.6], patience=2, metric="score", greater=False)
    assert stopped == 3


def test_missing_metric_makes_no_decision(caplog):
    args, cb = _args(), EarlyStoppingCallback(1)
    state, control = TrainerState(best_metric=0.5), TrainerControl()
    cb.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.1})
    assert not control.should_training_stop and cb.early_stopping_patience_counter == 0
    assert "eval_loss" in caplog.text


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"metric_for_best_model": None}, "metric_for_best_model"),
        ({"eval_strategy": "no"}, "eval_strategy"),
    ],
)
def test_requirements_checked_at_train_begin(kw, match):
    with pytest.raises(ConfigurationError, match=match):
        EarlyStoppingCallback().on_train_begin(_args(**kw), TrainerState(), TrainerControl())


def test_warns_without_load_best_model_at_end(caplog):
    EarlyStoppingCallback().on_train_begin(
        _args(load_best_model_at_end=False), TrainerState(), TrainerControl()
    )
    assert "load_best_model_at_end" in caplog.text


@pytest.mark.parametrize(("patience", "threshold"), [(0, 0.0), (1, -0.1)])
def test_bad_parameters(patience, threshold):
    with pytest.raises(ConfigurationError):
        EarlyStoppingCallback(patience, threshold)


def test_state_round_trip():
    _, cb = run_evals([1.0, 1.1, 1.2], patience=5)
    saved = cb.state()
    assert saved["attributes"]["early_stopping_patience_counter"] == 2
    restored = EarlyStoppingCallback.from_state(saved)
    assert restored.early_stopping_patience == 5
    assert restored.early_stopping_patience_counter == 2
