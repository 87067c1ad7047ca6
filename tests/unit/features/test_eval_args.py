"""FeatureArguments merged into the core TrainingArguments, as the Trainer will use it."""

from __future__ import annotations

import warnings

import pytest

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.arguments import FeatureArguments
from trainer_runtime.training_args import TrainingArguments

Args = TrainingArguments  # FeatureArguments is one of its bases


def make(**kw):
    return Args(output_dir="/tmp/g-features/out", **kw)


def test_defaults_follow_hugging_face():
    a = make()
    assert (a.eval_strategy, a.eval_steps, a.prediction_loss_only) == ("no", None, False)
    assert a.eval_do_concat_batches is True and a.eval_accumulation_steps is None
    assert a.include_for_metrics == [] and a.batch_eval_metrics is False
    assert (a.logging_nan_inf_filter, a.log_level, a.log_level_replica) == (
        True,
        "passive",
        "warning",
    )
    assert a.include_num_input_tokens_seen == "no" and a.disable_tqdm is None
    assert a.report_to == "none" and a.report_to_list == [] and a.project == "huggingface"
    assert a.metric_for_best_model is None and a.greater_is_better is None
    assert (a.bf16, a.fp16, a.tf32, a.torch_compile) == (False, False, None, False)
    assert a.label_smoothing_factor == 0.0
    FeatureArguments()  # the group stands alone too


def test_eval_steps_default_to_logging_steps():
    assert make(eval_strategy="steps", logging_steps=25).eval_steps == 25
    assert make(eval_strategy="steps", eval_steps=0.25).eval_steps == 0.25


@pytest.mark.parametrize(
    ("kw", "metric", "greater"),
    [
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "save_steps": 500},
            "loss",
            False,
        ),
        ({"save_strategy": "best", "eval_strategy": "epoch"}, "loss", False),
        ({"metric_for_best_model": "accuracy"}, "accuracy", True),
        ({"metric_for_best_model": "eval_loss"}, "eval_loss", False),
        ({"metric_for_best_model": "perplexity", "greater_is_better": False}, "perplexity", False),
    ],
)
def test_best_model_defaults(kw, metric, greater):
    a = make(**kw)
    assert (a.metric_for_best_model, a.greater_is_better) == (metric, greater)


def test_recipe_save_strategy_best():
    a = make(
        eval_strategy="epoch",
        save_strategy="best",
        metric_for_best_model="perplexity",
        greater_is_better=False,
        load_best_model_at_end=True,
    )
    assert a.save_strategy == "best"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"load_best_model_at_end": True}, "eval_strategy='no'"),
        ({"load_best_model_at_end": True, "eval_strategy": "epoch"}, "match eval_strategy"),
        (
            {
                "load_best_model_at_end": True,
                "eval_strategy": "steps",
                "eval_steps": 100,
                "save_steps": 250,
            },
            "multiple of eval_steps",
        ),
        ({"save_strategy": "best"}, "save_strategy='best'"),
        ({"eval_on_start": True}, "eval_on_start"),
        ({"bf16": True, "fp16": True}, "exclusive"),
        ({"bf16_full_eval": True, "fp16_full_eval": True}, "exclusive"),
        ({"include_for_metrics": ["inputs", "logits"]}, "include_for_metrics"),
        ({"include_num_input_tokens_seen": "some"}, "include_num_input_tokens_seen"),
        ({"log_level": "loud"}, "log_level"),
        ({"report_to": "tensorbord"}, "unknown integration"),
        ({"report_to": ["clearml"]}, "no 'clearml' integration"),
        ({"eval_steps": 1.5}, "eval_steps"),
        ({"eval_steps": 0}, "eval_steps"),
        ({"eval_accumulation_steps": 0}, "eval_accumulation_steps"),
        ({"label_smoothing_factor": 1.0}, "label_smoothing_factor"),
        ({"torch_compile_mode": "fastest"}, "torch_compile_mode"),
        ({"torch_empty_cache_steps": 0}, "torch_empty_cache_steps"),
        ({"activation_checkpointing_kwargs": "{bad"}, "activation_checkpointing_kwargs"),
    ],
)
def test_invalid_combinations_fail_naming_the_field(kw, match):
    with pytest.raises(ConfigurationError, match=match):
        make(**kw)


def test_assignment_is_validated_too():
    a = make(eval_strategy="steps", eval_steps=10, load_best_model_at_end=True, save_steps=20)
    with pytest.raises(ConfigurationError, match="match eval_strategy"):
        a.save_strategy = "epoch"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("none", []),
        ("tensorboard", ["tensorboard"]),
        (["tensorboard", "wandb"], ["tensorboard", "wandb"]),
        ("all", ["all"]),
    ],
)
def test_report_to(value, expected):
    assert make(report_to=value).report_to_list == expected


def test_tokens_seen_bool():
    assert make(include_num_input_tokens_seen=True).include_num_input_tokens_seen == "all"


def test_gradient_checkpointing_alias():
    with pytest.warns(FutureWarning, match="deprecated"):
        a = make(
            gradient_checkpointing=True, gradient_checkpointing_kwargs='{"use_reentrant": false}'
        )
    assert a.activation_checkpointing is True
    assert a.activation_checkpointing_kwargs == {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a.logging_steps = 10  # no second warning on re-validation
    with pytest.raises(ConfigurationError, match="contradicts"), pytest.warns(FutureWarning):
        make(activation_checkpointing=False, gradient_checkpointing=True)


def test_compile_backend_or_mode_turns_compile_on():
    assert make(torch_compile_backend="eager").torch_compile is True
    assert make(torch_compile_mode="reduce-overhead").torch_compile is True
    assert make().torch_compile is False
