from __future__ import annotations

import pytest

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import ENV_OUTPUT_DIR
from trainer_runtime.training_args import TrainingArguments


@pytest.fixture(autouse=True)
def _no_operator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_OUTPUT_DIR, raising=False)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"learning_rate": -1.0}, ["learning_rate=-1.0", "greater than or equal to 0"]),
        ({"per_device_train_batch_size": 0}, ["per_device_train_batch_size=0"]),
        ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps=0"]),
        ({"max_steps": 0}, ["max_steps=0", "-1 to train num_train_epochs"]),
        ({"max_steps": -5}, ["max_steps=-5"]),
        ({"num_train_epochs": 0}, ["num_train_epochs=0"]),
        ({"save_steps": 2.5}, ["save_steps=2.5", "neither a whole step count nor a ratio"]),
        ({"save_steps": 0}, ["save_steps=0", "must be > 0"]),
        ({"logging_steps": -1}, ["logging_steps=-1"]),
        ({"warmup_steps": 1.5}, ["warmup_steps=1.5"]),
        ({"save_strategy": "bestest"}, ["save_strategy='bestest'", "'best'"]),
        ({"save_strategy": "best"}, ["save_strategy='best'", "eval_strategy='no'"]),
        ({"optim": "adam"}, ["optim='adam'", "adamw_torch"]),
        ({"lr_scheduler_type": "cosine_annealing"}, ["lr_scheduler_type='cosine_annealing'"]),
        ({"lr_scheduler_kwargs": "{not json"}, ["lr_scheduler_kwargs", "not a JSON object"]),
        ({"save_total_limit": 0}, ["save_total_limit=0"]),
        ({"adam_beta2": 1.0}, ["adam_beta2=1.0"]),
        ({"report_to": "wandbb"}, ["report_to='wandbb'", "unknown integration"]),
        ({"train_sampling_strategy": "shuffled"}, ["train_sampling_strategy='shuffled'", "random"]),
        (
            {"learnig_rate": 1e-3},
            ["learnig_rate: unknown argument", "did you mean 'learning_rate'"],
        ),
    ],
)
def test_invalid_values_name_field_value_and_fix(kwargs: dict, expected: list[str]) -> None:
    with pytest.raises(ConfigurationError) as info:
        TrainingArguments(output_dir="out", **kwargs)
    message = str(info.value)
    for fragment in expected:
        assert fragment in message, message
    assert isinstance(info.value, ValueError)


def test_several_errors_reported_at_once() -> None:
    with pytest.raises(ConfigurationError) as info:
        TrainingArguments(output_dir="out", learning_rate=-1, max_steps=0)
    assert "2 error(s)" in str(info.value)


def test_output_dir_required_without_env() -> None:
    with pytest.raises(ConfigurationError, match=r"output_dir is required.*PREEMPTIBLE_OUTPUT_DIR"):
        TrainingArguments()


def test_operator_env_sets_output_dir_and_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TrainingArguments(output_dir="out").enable_jit_checkpoint is False
    monkeypatch.setenv(ENV_OUTPUT_DIR, "memory://job/ckpt")
    args = TrainingArguments()
    assert args.output_dir == "memory://job/ckpt"
    assert args.enable_jit_checkpoint is True
    assert TrainingArguments(enable_jit_checkpoint=False).enable_jit_checkpoint is False


def test_hf_defaults() -> None:
    args = TrainingArguments(output_dir="out")
    assert args.per_device_train_batch_size == 8
    assert args.num_train_epochs == 3.0
    assert args.max_steps == -1
    assert args.learning_rate == 5e-5
    assert args.lr_scheduler_type == "linear"
    assert args.optim == "adamw_torch_fused"
    assert args.weight_decay == 0.0
    assert (args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (0.9, 0.999, 1e-8)
    assert args.max_grad_norm == 1.0
    assert args.save_strategy == "steps" and args.save_steps == 500
    assert args.save_total_limit is None and args.save_only_model is False
    assert args.seed == 42 and args.data_seed is None
    assert args.logging_steps == 500 and args.report_to == "none"


def test_ratios_and_json_kwargs() -> None:
    args = TrainingArguments(
        output_dir="out",
        save_steps=0.25,
        logging_steps=10.0,
        warmup_steps=0.1,
        lr_scheduler_kwargs='{"num_cycles": 2}',
        num_train_epochs=0.5,
    )
    assert args.save_steps == 0.25 and args.steps_from_ratio(args.save_steps, 10) == 3
    assert args.logging_steps == 10 and isinstance(args.logging_steps, int)
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}
    assert args.num_train_epochs == 0.5


def test_assignment_is_validated() -> None:
    args = TrainingArguments(output_dir="out")
    args.max_steps = 7
    assert args.max_steps == 7
    with pytest.raises(ConfigurationError, match="learning_rate"):
        args.learning_rate = -0.5
    assert args.learning_rate == 5e-5
