"""TrainingArguments against transformers 5.x's, side by side: fields and defaults,
HfArgumentParser, dataclasses, members, learning-rate schedules and optimizers."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import HfArgumentParser  # noqa: E402
from transformers import Trainer as HfTrainer  # noqa: E402
from transformers import TrainingArguments as HfTrainingArguments  # noqa: E402
from transformers.optimization import get_scheduler  # noqa: E402
from transformers.trainer_utils import SchedulerType  # noqa: E402
from transformers.training_args import OptimizerNames  # noqa: E402

from trainer_runtime.errors import ConfigurationError  # noqa: E402
from trainer_runtime.features.optim import (  # noqa: E402
    TORCH_OPTIMIZERS,
    create_optimizer,
    create_scheduler,
    optimizer_cls_and_kwargs,
)
from trainer_runtime.protocol import ENV_OUTPUT_DIR  # noqa: E402
from trainer_runtime.training_args import (  # noqa: E402
    OPTIMIZER_NAMES,
    RUNTIME_ONLY_FIELDS,
    SCHEDULER_TYPES,
    EnvDefault,
    TrainingArguments,
    check_runtime_support,
)


@pytest.fixture(autouse=True)
def _no_operator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_OUTPUT_DIR, raising=False)


def _default(spec: dataclasses.Field[Any]) -> Any:
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    if isinstance(spec.default, EnvDefault):  # decided by the operator's environment (unset here)
        return spec.default.resolve()
    return spec.default


# Values that differ after construction, on purpose (docs/trainer.md, "Differences").
POST_INIT_EXCEPTIONS = {
    # kept as given ("none", a name or a list); report_to_list gives the list transformers holds
    "report_to",
    # resolved when the Trainer starts, after log_level is applied (transformers: at parse time)
    "disable_tqdm",
    # normalised to the list of options (transformers keeps None / the string)
    "fsdp",
}


# -- fields ----------------------------------------------------------------------------------------


def test_every_transformers_field_exists_with_the_same_default() -> None:
    ours = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    theirs = {f.name: f for f in dataclasses.fields(HfTrainingArguments)}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"fields of transformers' TrainingArguments we lack: {missing}"
    different = {
        name: (_default(ours[name]), _default(spec))
        for name, spec in theirs.items()
        if _default(ours[name]) != _default(spec)
    }
    assert not different, different
    # output_dir is the first field, so TrainingArguments("out") works as in transformers.
    assert next(iter(ours)) == "output_dir"
    assert TrainingArguments("out").output_dir == "out"


def test_values_after_construction_match_transformers() -> None:
    ours = TrainingArguments(output_dir="out").to_dict()
    theirs = HfTrainingArguments(output_dir="out").to_dict()
    different = {
        k: (ours[k], v) for k, v in theirs.items() if k not in POST_INIT_EXCEPTIONS and ours[k] != v
    }
    assert not different, different
    assert TrainingArguments(output_dir="out").report_to_list == theirs["report_to"] == []


def test_our_own_fields_are_still_there() -> None:
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert {"enable_jit_checkpoint", "train_sampling_strategy", "length_column_name"} <= names
    assert set(RUNTIME_ONLY_FIELDS) <= names


def test_enum_and_literal_choices_cover_transformers() -> None:
    assert set(OPTIMIZER_NAMES) == {o.value for o in OptimizerNames}
    assert set(SCHEDULER_TYPES) == {s.value for s in SchedulerType}
    # transformers' enum members are accepted too
    args = TrainingArguments(
        output_dir="out", optim=OptimizerNames.SGD, lr_scheduler_type=SchedulerType.COSINE
    )
    assert (args.optim, args.lr_scheduler_type) == ("sgd", "cosine")


# -- HfArgumentParser ------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "checkpoint"})
    config_overrides: str | None = field(default=None, metadata={"help": "config overrides"})
    dtype: str | None = field(
        default=None, metadata={"choices": ["auto", "bfloat16", "float16", "float32"]}
    )
    trust_remote_code: bool = field(default=False)


@dataclass
class DataTrainingArguments:
    dataset_name: str | None = field(default=None)
    dataset_config_name: str | None = field(default=None)
    block_size: int | None = field(default=None)
    max_train_samples: int | None = field(default=None)
    streaming: bool = field(default=False)
    validation_split_percentage: int | None = field(default=5)
    preprocessing_num_workers: int | None = field(default=None)
    keep_linebreaks: bool = field(default=True)


RUN_CLM_ARGV = [
    "--model_name_or_path", "openai-community/gpt2",
    "--dataset_name", "wikitext",
    "--dataset_config_name", "wikitext-2-raw-v1",
    "--block_size", "128",
    "--no_keep_linebreaks",
    "--output_dir", "/tmp/test-clm",
    "--do_train",
    "--do_eval",
    "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "4",
    "--gradient_accumulation_steps", "2",
    "--learning_rate", "3e-4",
    "--weight_decay", "0.01",
    "--num_train_epochs", "2",
    "--lr_scheduler_type", "cosine_with_min_lr",
    "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}',
    "--warmup_steps", "0.05",
    "--optim", "adamw_torch",
    "--optim_args", "foo=1",
    "--eval_strategy", "steps",
    "--eval_steps", "50",
    "--save_strategy", "steps",
    "--save_steps", "100",
    "--save_total_limit", "2",
    "--logging_steps", "10",
    "--logging_first_step",
    "--report_to", "none",
    "--seed", "7",
    "--load_best_model_at_end",
    "--metric_for_best_model", "eval_loss",
    "--label_names", "labels", "extra_labels",
    "--no_remove_unused_columns",
    "--dataloader_num_workers", "2",
    "--accelerator_config", '{"split_batches": true}',
    "--include_for_metrics", "loss",
    "--resume_from_checkpoint", "/tmp/test-clm/checkpoint-100",
    "--hub_strategy", "checkpoint",
    "--local_rank", "0",
    "--max_grad_norm", "0.5",
    "--use_cpu",
]  # fmt: skip


def _parse(args_cls: type, argv: list[str]) -> tuple[Any, ...]:
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, args_cls))
    return parser.parse_args_into_dataclasses(args=argv)


def test_hf_argument_parser_parses_a_run_clm_command_line_like_transformers() -> None:
    model_args, data_args, ours = _parse(TrainingArguments, RUN_CLM_ARGV)
    _, _, theirs = _parse(HfTrainingArguments, RUN_CLM_ARGV)
    assert isinstance(ours, TrainingArguments)
    assert model_args.model_name_or_path == "openai-community/gpt2"
    assert data_args.block_size == 128 and data_args.keep_linebreaks is False
    ours_d, theirs_d = ours.to_dict(), theirs.to_dict()
    different = {
        k: (ours_d[k], v)
        for k, v in theirs_d.items()
        if k not in POST_INIT_EXCEPTIONS and ours_d[k] != v
    }
    assert not different, different
    assert ours.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert ours.accelerator_config.split_batches is True
    assert ours.label_names == ["labels", "extra_labels"]
    assert ours.do_train and ours.do_eval and ours.remove_unused_columns is False


def test_hf_argument_parser_reads_every_field_type() -> None:
    # Every field can be registered (HfArgumentParser needs one parsable type per field).
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        args=[
            "--output_dir", "o",
            "--fsdp", "full_shard auto_wrap",
            "--fsdp_config", '{"min_num_params": 10}',
            "--debug", "underflow_overflow",
            "--optim_target_modules", "all-linear",
            "--include_num_input_tokens_seen", "true",
            "--tf32", "false",
            "--disable_tqdm", "true",
            "--train_sampling_strategy", "group_by_length",
            "--deepspeed", '{"zero_optimization": {"stage": 2}}',
        ]
    )  # fmt: skip
    assert args.fsdp == ["full_shard", "auto_wrap"]
    assert args.fsdp_config.min_num_params == 10
    assert args.debug == ["underflow_overflow"]
    assert args.optim_target_modules == "all-linear"
    assert args.include_num_input_tokens_seen == "all"
    assert args.tf32 is False and args.disable_tqdm is True
    assert args.train_sampling_strategy == "group_by_length"
    assert args.deepspeed == {"zero_optimization": {"stage": 2}}


def test_hf_argument_parser_json_file_and_dict(tmp_path: Path) -> None:
    config = {
        "model_name_or_path": "gpt2",
        "dataset_name": "wikitext",
        "output_dir": str(tmp_path / "out"),
        "learning_rate": 1e-4,
        "lr_scheduler_type": "warmup_stable_decay",
        "lr_scheduler_kwargs": {"num_decay_steps": 10},
        "eval_strategy": "epoch",
        "save_strategy": "epoch",
        "report_to": ["tensorboard"],
        "fsdp_config": {"min_num_params": 1},
    }
    path = tmp_path / "args.json"
    path.write_text(json.dumps(config))
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fsdp_config without fsdp
        _, _, from_file = parser.parse_json_file(str(path))
        _, _, from_dict = parser.parse_dict(config)
    for args in (from_file, from_dict):
        assert args.learning_rate == 1e-4
        assert args.lr_scheduler_kwargs == {"num_decay_steps": 10}
        assert args.do_eval is True  # eval_strategy != "no", as in transformers
        assert args.report_to == ["tensorboard"]
    assert from_file == from_dict


def test_invalid_values_from_the_command_line_name_the_field() -> None:
    parser = HfArgumentParser(TrainingArguments)
    with pytest.raises(ConfigurationError, match=r"learning_rate=-1\.0"):
        parser.parse_args_into_dataclasses(args=["--output_dir", "o", "--learning_rate", "-1"])


def test_dataclass_subclass_is_parsed_and_validated() -> None:
    @dataclass
    class MyArguments(TrainingArguments):
        my_flag: bool = field(default=False, metadata={"help": "mine"})

    (args,) = HfArgumentParser(MyArguments).parse_args_into_dataclasses(
        args=["--output_dir", "o", "--my_flag", "--eval_strategy", "epoch"]
    )
    assert args.my_flag is True and args.do_eval is True
    with pytest.raises(ConfigurationError, match="per_device_train_batch_size=0"):
        MyArguments(output_dir="o", per_device_train_batch_size=0)
    assert args.to_dict()["my_flag"] is True


# -- dataclasses -----------------------------------------------------------------------------------


def test_dataclasses_replace_asdict_fields() -> None:
    args = TrainingArguments(output_dir="out", learning_rate=1e-3)
    copy = dataclasses.replace(args, learning_rate=2e-3, eval_strategy="steps")
    assert copy.learning_rate == 2e-3 and args.learning_rate == 1e-3
    assert copy.eval_steps == 500 and copy.do_eval is True  # re-validated, derived again
    with pytest.raises(ConfigurationError, match="max_steps=0"):
        dataclasses.replace(args, max_steps=0)
    assert dataclasses.asdict(args)["learning_rate"] == 1e-3
    assert dataclasses.is_dataclass(args)
    assert TrainingArguments(**{**args.to_dict(), "hub_token": None}) == args


def test_assignment_validated_and_invalid_values_name_the_field() -> None:
    args = TrainingArguments(output_dir="out")
    with pytest.raises(ConfigurationError, match="optim='adam'"):
        args.optim = "adam"
    assert args.optim == "adamw_torch_fused"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"optim": "adam"}, "optim='adam'"),
        ({"lr_scheduler_type": "cosine_annealing"}, "lr_scheduler_type='cosine_annealing'"),
        ({"hub_strategy": "sometimes"}, "hub_strategy='sometimes'"),
        ({"debug": "everything"}, "debug='everything'"),
        ({"optim_args": "momentum"}, "optim_args='momentum'"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "set eval_strategy"),
        ({"lr_scheduler_kwargs": "[1, 2]"}, "lr_scheduler_kwargs"),
        ({"learnig_rate": 1.0}, "did you mean 'learning_rate'"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(ConfigurationError) as info:
            TrainingArguments(output_dir="out", **kwargs)
        assert fragment in str(info.value), (kwargs, str(info.value))
    # an unknown argument is a TypeError too, as a dataclass raises
    with pytest.raises(TypeError):
        TrainingArguments(output_dir="out", learnig_rate=1.0)


def test_metric_schedulers_default_the_metric_like_transformers() -> None:
    kwargs = {"output_dir": "out", "lr_scheduler_type": "reduce_lr_on_plateau"}
    ours = TrainingArguments(**kwargs, eval_strategy="epoch")
    theirs = HfTrainingArguments(**kwargs, eval_strategy="epoch")
    assert (ours.metric_for_best_model, ours.greater_is_better) == (
        theirs.metric_for_best_model,
        theirs.greater_is_better,
    )


# -- members ---------------------------------------------------------------------------------------


def test_members_match_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = TrainingArguments(output_dir="out", use_cpu=True, warmup_steps=0.1)
    theirs = HfTrainingArguments(output_dir="out", use_cpu=True, warmup_steps=0.1)
    for steps in (1, 9, 10, 101):
        assert ours.get_warmup_steps(steps) == theirs.get_warmup_steps(steps)
    for name in (
        "device",
        "n_gpu",
        "world_size",
        "process_index",
        "local_process_index",
        "train_batch_size",
        "eval_batch_size",
        "should_log",
        "should_save",
        "place_model_on_device",
        "ddp_timeout_delta",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.parallel_mode.value == theirs.parallel_mode.value
    # "passive" keeps the current level: of transformers' logger there, of ours here.
    runtime_logger = logging.getLogger("trainer_runtime")
    before = (runtime_logger.level, transformers.logging.get_verbosity())
    try:
        for level in (logging.INFO, logging.WARNING):
            runtime_logger.setLevel(level)
            transformers.logging.set_verbosity(level)
            assert ours.get_process_log_level() == theirs.get_process_log_level() == level
    finally:
        runtime_logger.setLevel(before[0])
        transformers.logging.set_verbosity(before[1])
    ours.log_level = theirs.log_level = "error"
    assert ours.get_process_log_level() == theirs.get_process_log_level() == logging.ERROR
    with ours.main_process_first(desc="map"):
        pass
    sanitized = ours.to_sanitized_dict()
    assert set(sanitized) == set(theirs.to_sanitized_dict()) | set(RUNTIME_ONLY_FIELDS)
    assert all(type(v) in (bool, int, float, str) for v in sanitized.values())
    assert json.loads(ours.to_json_string()) == ours.to_dict()
    assert "<HUB_TOKEN>" in str(TrainingArguments(output_dir="o", hub_token="secret"))
    assert "secret" not in TrainingArguments(output_dir="o", hub_token="secret").to_json_string()

    # A replica of a 2-node run: rank 3, local rank 1.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    replica = TrainingArguments(output_dir="out", log_level="info", log_level_replica="error")
    assert (replica.world_size, replica.process_index, replica.local_process_index) == (4, 3, 1)
    assert not replica.should_log and not replica.should_save
    assert replica.get_process_log_level() == 40  # logging.ERROR


@pytest.mark.parametrize(
    ("method", "kwargs"),
    [
        ("set_training", {"learning_rate": 1e-4, "batch_size": 32, "max_steps": 7}),
        ("set_evaluate", {"strategy": "steps", "steps": 100, "batch_size": 4}),
        ("set_testing", {"batch_size": 16, "loss_only": True}),
        ("set_save", {"strategy": "steps", "steps": 100, "total_limit": 3}),
        ("set_logging", {"strategy": "steps", "steps": 25, "level": "info"}),
        ("set_push_to_hub", {"model_id": "me/model", "strategy": "end", "token": "t"}),
        ("set_optimizer", {"name": "sgd", "beta1": 0.8, "args": "momentum=0.9"}),
        ("set_lr_scheduler", {"name": "cosine", "warmup_steps": 0.05, "max_steps": 9}),
        ("set_dataloader", {"train_batch_size": 16, "num_workers": 2, "sampler_seed": 3}),
    ],
)
def test_set_helpers_match_transformers(method: str, kwargs: dict[str, Any]) -> None:
    ours = TrainingArguments(output_dir="out")
    theirs = HfTrainingArguments(output_dir="out")
    assert getattr(ours, method)(**kwargs) is ours
    getattr(theirs, method)(**kwargs)
    ours_d, theirs_d = ours.to_dict(), theirs.to_dict()
    # transformers' set_evaluate stores its default delay=None in the float field eval_delay;
    # we store 0 (no delay), which is what None means there.
    exceptions = POST_INIT_EXCEPTIONS | ({"eval_delay"} if method == "set_evaluate" else set())
    different = {
        k: (ours_d[k], v) for k, v in theirs_d.items() if k not in exceptions and ours_d[k] != v
    }
    assert not different, different
    if method == "set_evaluate":
        assert ours.eval_delay == 0 and theirs.eval_delay is None


# -- learning-rate schedules -----------------------------------------------------------------------

SCHEDULE_CASES: list[tuple[str, dict[str, Any] | None, float]] = [
    ("linear", None, 3),
    ("linear", None, 0.25),
    ("cosine", None, 3),
    ("cosine", {"num_cycles": 1.5}, 2),
    ("cosine_with_restarts", {"num_cycles": 3}, 3),
    ("polynomial", None, 3),
    ("polynomial", {"lr_end": 1e-3, "power": 2.0}, 0),
    ("constant", None, 3),
    ("constant_with_warmup", None, 4),
    ("inverse_sqrt", None, 3),
    ("inverse_sqrt", None, 0),
    ("inverse_sqrt", {"timescale": 7}, 3),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, 3),
    ("cosine_with_min_lr", {"min_lr": 0.01, "num_cycles": 1.0}, 0),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}, 4),
    ("cosine_warmup_with_min_lr", {"min_lr": 0.02, "warmup_lr_rate": 0.1}, 4),
    ("warmup_stable_decay", {"num_decay_steps": 6}, 3),
    (
        "warmup_stable_decay",
        {
            "num_decay_steps": 5,
            "warmup_type": "cosine",
            "decay_type": "1-sqrt",
            "min_lr_ratio": 0.2,
        },
        4,
    ),
    (
        "warmup_stable_decay",
        {"num_decay_steps": 4, "num_stable_steps": 6, "warmup_type": "1-sqrt"},
        2,
    ),
    ("warmup_stable_decay", {"num_decay_steps": 8, "decay_type": "linear"}, 0.2),
]


def _optimizer(lr: float = 0.1) -> Any:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=lr)


def test_every_scheduler_type_is_covered() -> None:
    covered = {name for name, _, _ in SCHEDULE_CASES} | {"reduce_lr_on_plateau", "greedy"}
    assert covered == {s.value for s in SchedulerType}


@pytest.mark.parametrize(("name", "kwargs", "warmup"), SCHEDULE_CASES)
def test_lr_sequence_equals_transformers(
    name: str, kwargs: dict[str, Any] | None, warmup: float
) -> None:
    total = 20
    args = TrainingArguments(
        output_dir="out",
        lr_scheduler_type=name,
        lr_scheduler_kwargs=kwargs,
        warmup_steps=warmup,
        learning_rate=0.1,
    )
    ours_opt, theirs_opt = _optimizer(), _optimizer()
    ours = create_scheduler(ours_opt, args, total)
    theirs = get_scheduler(
        name,
        theirs_opt,
        num_warmup_steps=args.get_warmup_steps(total),
        num_training_steps=total,
        scheduler_specific_kwargs=dict(kwargs or {}),
    )
    ours_lrs, theirs_lrs = [], []
    for _ in range(total + 3):  # and past the end
        ours_lrs.append(ours.get_last_lr()[0])
        theirs_lrs.append(theirs.get_last_lr()[0])
        for opt, sched in ((ours_opt, ours), (theirs_opt, theirs)):
            opt.step()
            sched.step()
    assert ours_lrs == pytest.approx(theirs_lrs, rel=1e-12, abs=1e-15)
    assert len(set(ours_lrs)) > 1 or name == "constant"


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("reduce_lr_on_plateau", {"patience": 1, "factor": 0.5}),
        ("reduce_lr_on_plateau", None),
        ("greedy", {"patience": 1, "min_lr": 1e-4}),
    ],
)
def test_metric_driven_schedules_equal_transformers(
    name: str, kwargs: dict[str, Any] | None
) -> None:
    args = TrainingArguments(
        output_dir="out", lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, eval_strategy="epoch"
    )
    ours_opt, theirs_opt = _optimizer(), _optimizer()
    with pytest.raises(ConfigurationError, match="evaluation metric"):
        create_scheduler(ours_opt, args, 10)  # the Trainer's loop cannot step it yet
    ours = create_scheduler(ours_opt, args, 10, metric_driven=True)
    theirs = get_scheduler(name, theirs_opt, scheduler_specific_kwargs=dict(kwargs or {}))
    assert type(ours) is type(theirs)
    metrics = [1.0, 0.9, 0.95, 0.97, 0.99, 0.5, 0.4, 0.6, 0.7, 0.8, 0.9, 1.0]
    for metric in metrics:
        ours.step(metric)
        theirs.step(metric)
        assert ours_opt.param_groups[0]["lr"] == theirs_opt.param_groups[0]["lr"]


def test_scheduler_kwargs_errors_name_the_fix() -> None:
    for name, kwargs, fragment in [
        ("cosine_with_min_lr", None, "min_lr"),
        ("cosine_with_min_lr", {"min_lr": 0.1, "min_lr_rate": 0.1}, "not both"),
        ("warmup_stable_decay", None, "num_decay_steps"),
        ("warmup_stable_decay", {"num_decay_steps": 2, "decay_type": "exp"}, "decay_type='exp'"),
        ("inverse_sqrt", {"num_cycles": 2}, "not accepted"),
    ]:
        args = TrainingArguments(output_dir="o", lr_scheduler_type=name, lr_scheduler_kwargs=kwargs)
        with pytest.raises(ConfigurationError, match=fragment):
            create_scheduler(_optimizer(), args, 10)


# -- optimizers ------------------------------------------------------------------------------------

OPTIM_CASES: list[tuple[str, str | None]] = [
    ("adamw_torch", None),
    ("adamw_torch_fused", None),
    ("adafactor", None),
    ("sgd", None),
    ("sgd", "momentum=0.9,nesterov=True,dampening=0"),
    ("adagrad", None),
    ("adagrad", "lr_decay=0.01,eps=1e-6"),
    ("rmsprop", None),
    ("rmsprop", "momentum=0.5,alpha=0.9,centered=true"),
]


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 2)


def test_every_torch_optimizer_is_covered() -> None:
    assert {name for name, _ in OPTIM_CASES} == set(TORCH_OPTIMIZERS)


@pytest.mark.parametrize(("optim", "optim_args"), OPTIM_CASES)
def test_optimizer_equals_transformers(optim: str, optim_args: str | None) -> None:
    common = {
        "output_dir": "out",
        "optim": optim,
        "optim_args": optim_args,
        "learning_rate": 3e-3,
        "weight_decay": 0.1,
        "adam_beta1": 0.8,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-6,
        "use_cpu": True,
    }
    model = TinyModel()
    theirs_cls, theirs_kwargs = HfTrainer.get_optimizer_cls_and_kwargs(
        HfTrainingArguments(**common), model
    )
    ours_args = TrainingArguments(**common)
    ours_cls, ours_kwargs = optimizer_cls_and_kwargs(ours_args, model)
    assert ours_cls is theirs_cls
    assert ours_kwargs == theirs_kwargs
    if optim == "adamw_torch_fused" and not _fused_available():
        return
    optimizer = create_optimizer(model, ours_args)
    assert type(optimizer) is theirs_cls
    reference = theirs_cls(model.parameters(), **theirs_kwargs)
    assert optimizer.defaults == reference.defaults
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def _fused_available() -> bool:
    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    except (RuntimeError, ValueError):
        return False
    return True


OPTIONAL_PACKAGES = {
    "adamw_bnb_8bit": "bitsandbytes",
    "paged_lion_8bit": "bitsandbytes",
    "rmsprop_bnb": "bitsandbytes",
    "ademamix": "bitsandbytes",
    "adamw_torch_4bit": "torchao",
    "grokadamw": "grokadamw",
    "stable_adamw": "optimi",
    "adamw_anyprecision": "torchdistx",
    "adamw_torch_xla": "torch_xla",
    "adamw_torch_npu_fused": "torch_npu",
}


@pytest.mark.parametrize("optim", sorted(OPTIONAL_PACKAGES))
def test_optional_package_optimizers_fail_clearly_without_their_package(optim: str) -> None:
    package = OPTIONAL_PACKAGES[optim]
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    args = TrainingArguments(output_dir="out", optim=optim)  # accepted at parse time
    with pytest.raises(ConfigurationError, match=rf"optim='{optim}' needs the '{package}'"):
        create_optimizer(TinyModel(), args)


@pytest.mark.parametrize(
    "optim", ["galore_adamw", "apollo_adamw_layerwise", "lomo", "adalomo", "schedule_free_adamw"]
)
def test_loop_optimizers_are_refused_with_the_reason(optim: str) -> None:
    args = TrainingArguments(output_dir="out", optim=optim, optim_target_modules="all-linear")
    with pytest.raises(ConfigurationError, match=rf"optim='{optim}' is not supported: .*loop"):
        create_optimizer(TinyModel(), args)


# -- accepted, refused when they would take effect -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"deepspeed": '{"zero_optimization": {"stage": 3}}'}, "deepspeed"),
        ({"use_liger_kernel": True}, "use_liger_kernel=True"),
        ({"push_to_hub": True, "hub_model_id": "me/m"}, "push_to_hub=True"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size=True"),
        ({"debug": "underflow_overflow"}, "debug="),
        ({"skip_memory_metrics": False}, "skip_memory_metrics=False"),
        ({"eval_use_gather_object": True}, "eval_use_gather_object=True"),
        ({"parallelism_config": object()}, "parallelism_config"),
    ],
)
def test_unsupported_features_are_accepted_then_refused_by_the_trainer(
    kwargs: dict[str, Any], fragment: str
) -> None:
    args = TrainingArguments(output_dir="out", **kwargs)
    with pytest.raises(ConfigurationError, match=fragment):
        check_runtime_support(args)


def test_trainer_refuses_unsupported_features_at_construction(tmp_path: Path) -> None:
    from trainer_runtime.trainer import Trainer

    args = TrainingArguments(output_dir=str(tmp_path), use_liger_kernel=True, use_cpu=True)
    with pytest.raises(ConfigurationError, match="Liger"):
        Trainer(model=TinyModel(), args=args)
    check_runtime_support(TrainingArguments(output_dir="out"))  # defaults pass


def test_every_field_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    missing = [
        f.name for f in dataclasses.fields(TrainingArguments) if f"| `{f.name}` |" not in doc
    ]
    assert not missing, f"fields missing from the arguments table of docs/trainer.md: {missing}"
