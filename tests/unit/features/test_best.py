from __future__ import annotations

import math

import pytest

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.best import (
    best_rotation_victims,
    default_greater_is_better,
    is_better,
    metric_key,
    resolve_metric_for_best_model,
    update_best,
    validate_best_model_settings,
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("accuracy", "eval_accuracy"),
        ("eval_accuracy", "eval_accuracy"),
        ("loss", "eval_loss"),
        ("eval_data1_loss", "eval_data1_loss"),
        ("perplexity", "eval_perplexity"),
    ],
)
def test_metric_key_with_or_without_prefix(name: str, expected: str):
    assert metric_key(name) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (None, False),
        ("loss", False),
        ("eval_loss", False),
        ("eval_data2_loss", False),
        ("accuracy", True),
        ("eval_bleu", True),
        ("perplexity", True),
    ],
)
def test_greater_is_better_default_from_name(name: str | None, expected: bool):
    assert default_greater_is_better(name) is expected


@pytest.mark.parametrize(
    ("metric", "load_best", "strategy", "expected"),
    [
        (None, False, "steps", None),
        (None, True, "steps", "loss"),
        (None, False, "best", "loss"),
        ("f1", False, "steps", "f1"),
    ],
)
def test_resolve_metric_default_is_loss(metric, load_best, strategy, expected):
    got = resolve_metric_for_best_model(
        metric, load_best_model_at_end=load_best, save_strategy=strategy
    )
    assert got == expected


@pytest.mark.parametrize(
    ("value", "best", "greater", "expected"),
    [
        (1.0, None, True, True),
        (2.0, 1.0, True, True),
        (1.0, 1.0, True, False),
        (0.5, 1.0, False, True),
        (1.5, 1.0, False, False),
        (math.nan, 1.0, False, False),
        (1.0, math.nan, False, True),
    ],
)
def test_is_better_is_strict(value, best, greater, expected):
    assert is_better(value, best, greater) is expected


def test_save_strategy_best_decisions_over_a_run():
    """perplexity, lower is better: a checkpoint only when the metric improves."""
    evals = [9.0, 7.5, 8.0, 7.5, 6.0, 6.5]
    best = None
    saves = []
    for i, ppl in enumerate(evals):
        is_new, best = update_best(
            {"eval_perplexity": ppl},
            best_metric=best,
            metric_for_best_model="perplexity",
            greater_is_better=False,
        )
        saves.append(is_new)
        assert best == min(evals[: i + 1])
    assert saves == [True, True, False, False, True, False]


def test_update_best_default_direction_and_missing_metric():
    is_new, best = update_best(
        {"eval_accuracy": 0.7}, best_metric=0.6, metric_for_best_model="accuracy"
    )
    assert (is_new, best) == (True, 0.7)  # accuracy: greater is better by default
    is_new, best = update_best({"eval_loss": 0.7}, best_metric=0.6, metric_for_best_model="loss")
    assert (is_new, best) == (False, 0.6)  # loss: lower is better by default
    with pytest.raises(ConfigurationError, match=r"perplexity.*eval_loss"):
        update_best({"eval_loss": 1.0}, best_metric=None, metric_for_best_model="perplexity")


def _validate(**kw):
    base = dict(
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="steps",
        eval_steps=100,
        save_steps=500,
        metric_for_best_model=None,
    )
    base.update(kw)
    validate_best_model_settings(**base)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"save_strategy": "best"},
        {"save_strategy": "best", "save_steps": 7},
        {"eval_strategy": "epoch", "save_strategy": "epoch"},
        {"eval_steps": 0.1, "save_steps": 0.2},
        {"eval_steps": None, "save_steps": 500},
        {"load_best_model_at_end": False, "eval_strategy": "no", "save_strategy": "steps"},
        {"load_best_model_at_end": False, "save_steps": 7},
    ],
)
def test_valid_best_model_settings(kw):
    _validate(**kw)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"eval_strategy": "no"}, "eval_strategy='no'"),
        ({"eval_strategy": "epoch"}, "save_strategy to match eval_strategy"),
        ({"save_strategy": "no"}, "save_strategy to match eval_strategy"),
        ({"save_steps": 250}, "multiple of eval_steps"),
        ({"eval_steps": 0.1, "save_steps": 500}, "multiple of eval_steps"),
        ({"eval_steps": 0.2, "save_steps": 0.3}, "multiple of eval_steps"),
        (
            {"load_best_model_at_end": False, "save_strategy": "best", "eval_strategy": "no"},
            "save_strategy='best'",
        ),
    ],
)
def test_invalid_best_model_settings_fail_up_front(kw, match):
    with pytest.raises(ConfigurationError, match=match):
        _validate(**kw)


CKPTS = [f"checkpoint-{s}" for s in (100, 200, 300, 400, 500, 600)]


@pytest.mark.parametrize(
    ("limit", "best", "strategy", "victims"),
    [
        (None, None, "steps", []),
        (2, None, "steps", CKPTS[:4]),
        # save_total_limit=5 keeps the 4 most recent plus the best
        (5, "checkpoint-100", "steps", ["checkpoint-200"]),
        (3, "checkpoint-200", "steps", ["checkpoint-100", "checkpoint-300", "checkpoint-400"]),
        # best among the most recent: plain limit
        (3, "checkpoint-500", "steps", CKPTS[:3]),
        # limit 1 with an older best keeps best and newest
        (
            1,
            "checkpoint-300",
            "steps",
            [c for c in CKPTS if c not in ("checkpoint-300", "checkpoint-600")],
        ),
        # save_strategy='best': only the single best (plus the newest, e.g. a JIT checkpoint)
        (
            None,
            "checkpoint-400",
            "best",
            [c for c in CKPTS if c not in ("checkpoint-400", "checkpoint-600")],
        ),
        (None, "checkpoint-600", "best", CKPTS[:5]),
    ],
)
def test_rotation_keeps_best_and_most_recent(limit, best, strategy, victims):
    got = best_rotation_victims(
        CKPTS, save_total_limit=limit, best_checkpoint=best, save_strategy=strategy
    )
    assert got == victims
    assert CKPTS[-1] not in got and (best is None or best not in got)


def test_rotation_protect_and_bad_limit():
    got = best_rotation_victims(CKPTS, save_total_limit=1, protect={"checkpoint-100"})
    assert "checkpoint-100" not in got and len(got) == 4
    assert best_rotation_victims([], save_total_limit=1) == []
    with pytest.raises(ConfigurationError, match="save_total_limit"):
        best_rotation_victims(CKPTS, save_total_limit=0)
