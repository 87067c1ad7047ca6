"""TrainingArguments: every field of transformers 5.x with its name, type, default and checks.

``TrainingArguments`` is a standard-library dataclass, so ``HfArgumentParser``,
``dataclasses.fields`` / ``replace`` / ``asdict`` and ``@dataclass`` subclasses work as with
transformers. Its fields and checks are declared once, as pydantic field groups:
:class:`TrainingArgumentsSchema` (this module) inherits the groups of
:class:`trainer_runtime.features.arguments.FeatureArguments` (evaluation, logging, best model,
precision), :class:`trainer_runtime.data.arguments.DataArguments` (dataloader),
:class:`trainer_runtime.distributed.ddp_args.DdpArguments` and
:class:`trainer_runtime.distributed.fsdp_args.FsdpArguments`. The dataclass is generated from the
schema; ``__post_init__`` validates every field with it (so does every later assignment) and
raises :class:`~trainer_runtime.errors.ConfigurationError` naming the field, the value and the fix.

To add a field, put it in its group with a ``description`` (its ``--help`` text) and, when it
depends on other fields, check it in the group's model validator. Torch-free at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import json
import logging
import math
import os
from collections.abc import Iterator
from datetime import timedelta
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import to_jsonable_python

from trainer_runtime.data.arguments import ALL_SAMPLING_STRATEGIES, DataArguments
from trainer_runtime.distributed.ddp_args import DdpArguments
from trainer_runtime.distributed.fsdp_args import FsdpArguments
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.arguments import FeatureArguments
from trainer_runtime.features.logging_utils import LOG_LEVELS
from trainer_runtime.protocol import ENV_OUTPUT_DIR, ENV_STOP_POLICY, STOP_POLICIES

__all__ = [
    "DEBUG_OPTIONS",
    "ENV_DEFAULTS",
    "HUB_STRATEGIES",
    "OPTIMIZER_NAMES",
    "RUNTIME_ONLY_FIELDS",
    "SAMPLING_STRATEGIES",
    "SCHEDULER_TYPES",
    "EnvDefault",
    "ParallelMode",
    "TrainingArguments",
    "TrainingArgumentsSchema",
    "check_runtime_support",
]

logger = logging.getLogger(__name__)

# Fields transformers' TrainingArguments does not have (docs/trainer.md, differences).
RUNTIME_ONLY_FIELDS: tuple[str, ...] = (
    "jit_stop_policy",
    "save_async",
    "save_async_keep_snapshot",
    "checkpoint_direct_io",
    "cpu_malloc_tuning",
)

# Batch orders the trainer can build (trainer_runtime.data.samplers and length_sampling).
SAMPLING_STRATEGIES: tuple[str, ...] = ALL_SAMPLING_STRATEGIES

# transformers 5.x OptimizerNames, in its order. Which ones this runtime builds (and which need an
# optional package) is decided when the optimizer is created: trainer_runtime.features.optim.
OptimizerName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adafactor",
    "adamw_anyprecision",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "ademamix",
    "sgd",
    "adagrad",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "ademamix_8bit",
    "lion_8bit",
    "lion_32bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "lomo",
    "adalomo",
    "grokadamw",
    "schedule_free_radam",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "apollo_adamw",
    "apollo_adamw_layerwise",
    "stable_adamw",
]
OPTIMIZER_NAMES: tuple[str, ...] = OptimizerName.__args__  # type: ignore[attr-defined]

# transformers 5.x SchedulerType.
SchedulerName = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
]
SCHEDULER_TYPES: tuple[str, ...] = SchedulerName.__args__  # type: ignore[attr-defined]
# Schedules that follow an evaluation metric (they need an eval strategy).
METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")

HubStrategy = Literal["end", "every_save", "checkpoint", "all_checkpoints"]
HUB_STRATEGIES: tuple[str, ...] = HubStrategy.__args__  # type: ignore[attr-defined]
DEBUG_OPTIONS: tuple[str, ...] = ("underflow_overflow", "tpu_metrics_debug")


class ParallelMode(Enum):
    """How this process trains (transformers' ``ParallelMode`` values)."""

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"
    SAGEMAKER_MODEL_PARALLEL = "sagemaker_model_parallel"
    SAGEMAKER_DATA_PARALLEL = "sagemaker_data_parallel"
    TPU = "tpu"


def _default_output_dir() -> str | None:
    return os.environ.get(ENV_OUTPUT_DIR) or None


def _default_jit() -> bool:
    # Under the operator (which sets the output dir) preemption is expected: save on SIGTERM.
    return bool(os.environ.get(ENV_OUTPUT_DIR))


def _default_stop_policy() -> str:
    # The operator passes spec.gracePeriod.stopPolicy; a script's own value wins over it.
    return os.environ.get(ENV_STOP_POLICY, "").strip() or "finish_step"


class EnvDefault:
    """The default of a field the operator's environment decides, read when the arguments are built.

    The generated dataclass holds one of these as the field's plain ``default`` (the schema keeps
    the ``default_factory``), because transformers' ``HfArgumentParser`` gives a ``bool`` field
    whose default comes from a ``default_factory`` the default False, and reads the factory of
    other fields once, when the parser is made. A plain default is passed through unchanged
    (argparse converts only string defaults), so ``__post_init__`` resolves it the same way
    however the arguments are built; a value given explicitly replaces it, as any value does.
    ``str()`` is what ``--help`` shows.
    """

    __slots__ = ("factory", "rule")

    def __init__(self, factory: Any, rule: str) -> None:
        self.factory = factory
        self.rule = rule

    def resolve(self) -> Any:
        return self.factory()

    def __repr__(self) -> str:
        return f"<from the environment: {self.rule}>"

    def __str__(self) -> str:
        return f"{self.rule}; here {self.resolve()!r}"

    def __copy__(self) -> EnvDefault:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> EnvDefault:
        return self


def _resolve_env_defaults(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v.resolve() if isinstance(v, EnvDefault) else v for k, v in values.items()}


def _steps_or_ratio(name: str, value: float) -> float:
    """Values >= 1 are step counts (must be whole), values in (0, 1) ratios of the total steps."""
    if value <= 0:
        raise ValueError("must be > 0 (a step count, or a ratio in (0, 1) of the total steps)")
    if value >= 1 and value != int(value):
        raise ValueError(f"{value} is neither a whole step count nor a ratio below 1")
    return int(value) if value >= 1 else value


class TrainingArgumentsSchema(FeatureArguments, DataArguments, DdpArguments, FsdpArguments):
    """Fields and checks of :class:`TrainingArguments` (which is generated from this model)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

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
    auto_find_batch_size: bool = Field(
        False,
        description="Halve the batch size after an out-of-memory error and retry. Not supported "
        "by this runtime (refused when training starts).",
    )

    # -- optimizer ---------------------------------------------------------------------------------
    optim: OptimizerName = Field(
        "adamw_torch_fused",
        description="Optimizer: any transformers name. Built here: adamw_torch, "
        "adamw_torch_fused, adafactor, sgd, adagrad, rmsprop; the others when their package is "
        "installed (bitsandbytes, torchao, grokadamw, torch-optimi, ...).",
    )
    optim_args: str | None = Field(
        None,
        description="Extra optimizer arguments as 'key=value,key=value' (e.g. 'momentum=0.9' for "
        "sgd).",
    )
    # HfArgumentParser reads the union in this order (str second), as transformers writes it.
    optim_target_modules: None | str | list[str] = Field(  # noqa: RUF036
        None,
        description="Modules (names, a regex or 'all-linear') the GaLore/APOLLO optimizers "
        "project.",
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
    lr_scheduler_type: SchedulerName = Field(
        "linear", description=f"Learning-rate schedule: {', '.join(SCHEDULER_TYPES)}."
    )
    lr_scheduler_kwargs: dict[str, Any] | str | None = Field(
        None,
        description="Extra schedule arguments (e.g. cosine: num_cycles; polynomial: lr_end, "
        "power; cosine_with_min_lr: min_lr or min_lr_rate); a dict or a JSON string.",
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
    jit_stop_policy: str = Field(
        default_factory=_default_stop_policy,
        description="How a SIGTERM stops training (enable_jit_checkpoint): 'finish_step' "
        "finishes the optimizer step in flight, then saves, unless the rest of the step and the "
        "save would miss the deadline (SIGTERM + grace, or + the node's notice when shorter): "
        "then it stops as 'micro_batch' does; 'micro_batch' stops at the next micro-batch "
        "boundary, drops the partial gradient accumulation and saves the last completed step at "
        "once (the dropped micro-batches are trained again after resume). Default: "
        "$PREEMPTIBLE_STOP_POLICY, else 'finish_step'.",
    )
    save_async: bool | None = Field(
        None,
        description="preemptible only: write periodic checkpoints in the background. The state is "
        "copied to host memory at the step boundary (one extra host copy of model and optimizer "
        "state while the write is in flight), training continues while a writer thread writes, "
        "fsyncs and commits it (manifest last); at most one write in flight; a JIT stop cancels "
        "it (or waits, when it is of the same step). None: on under the operator's environment "
        "for a single process without FSDP, save_on_each_node, save_strategy='best', "
        "load_best_model_at_end or push_to_hub, else off.",
    )
    save_async_keep_snapshot: bool | None = Field(
        None,
        description="preemptible only (save_async): what becomes of the host memory a "
        "background save copies the state into (pinned, for GPU tensors: pinning is most of "
        "the training stall, about 0.45 s per GiB on an H200). None: decided per rank at the "
        "first save from the host memory left (MemAvailable, the cgroup limit) shared by the "
        "node's local ranks: kept when the snapshot is at most half a rank's part, else pinned "
        "ahead of each periodic save on a side thread and given back after its write, else "
        "pinned at the save (docs/checkpoints.md, 'Pinned staging'). True: kept and reused for "
        "the whole run (a copy of this rank's model and optimizer state held pinned: about 67 GB "
        "for a 7B full fine-tune on one GPU). False: pinned ahead of each save, given back once "
        "this rank's files are written.",
    )
    checkpoint_direct_io: bool = Field(
        False,
        description="preemptible only: write local checkpoint files with O_DIRECT, around the "
        "page cache, through 4 MiB aligned staging blocks kept for the process. Measured faster "
        "only on a small VM where first touching page-cache memory is slow (free page "
        "reporting), not elsewhere; and a resume on the same machine can then no longer read "
        "the checkpoint from the page cache. So it is off by default. Never used on FUSE; a "
        "filesystem that refuses O_DIRECT or an out-of-order write gets buffered, in-order "
        "writes. $PREEMPTIBLE_DIRECT_IO (1 or 0), when set, wins over this field.",
    )
    ignore_data_skip: bool = Field(
        False,
        description="On resume, do not restore the data position (start the epoch over instead of "
        "skipping to where the checkpoint was).",
    )
    restore_callback_states_from_checkpoint: bool = Field(
        False,
        description="On resume, restore the state of stateful callbacks (e.g. early stopping) "
        "saved in the checkpoint.",
    )

    # -- Hugging Face Hub --------------------------------------------------------------------------
    push_to_hub: bool = Field(
        False,
        description="Push the model (and, by hub_strategy, checkpoints) to hub_model_id, which "
        "must be an fsspec URL here (no Hub is reachable; a Hub repository id is refused).",
    )
    hub_token: str | None = Field(None, description="Hub token (only with push_to_hub).")
    hub_private_repo: bool | None = Field(
        None, description="Create the Hub repository as private (only with push_to_hub)."
    )
    hub_model_id: str | None = Field(
        None,
        description="Where push_to_hub writes: an fsspec URL (file:///..., s3://...) or an "
        "absolute path; a Hub repository id is refused (no Hub is reachable).",
    )
    hub_strategy: HubStrategy = Field(
        "every_save",
        description=f"What is pushed and when: {', '.join(HUB_STRATEGIES)} (only with "
        "push_to_hub).",
    )
    hub_always_push: bool = Field(
        False, description="Push even while the previous push runs (only with push_to_hub)."
    )
    hub_revision: str | None = Field(
        None, description="Hub revision (branch) to push to (only with push_to_hub)."
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

    # -- hardware and kernels ----------------------------------------------------------------------
    use_cpu: bool = Field(False, description="Train on CPU even when an accelerator is available.")
    cpu_malloc_tuning: bool = Field(
        False,
        description="preemptible only: when training on the CPU, tune glibc's allocator for the "
        "rest of the process (mallopt: M_MMAP_MAX 0, mmap threshold 32 MiB, trim threshold "
        "2 GiB) so that gradients freed after each step are reused, not page-faulted back in. "
        "Measured faster on the project's 2-core test VM, for more peak memory (the heap keeps "
        "what it once held); not measured elsewhere, so off by default. Skipped, with a "
        "warning, where MALLOC_* variables or GLIBC_TUNABLES set the same settings; reset in "
        "dataloader workers started by fork. $PREEMPTIBLE_HOST_MALLOC (1 or 0), when set, wins "
        "over this field.",
    )
    use_cache: bool = Field(
        False,
        description="Value of model.config.use_cache while the Trainer holds the model (key/value "
        "cache of generative models; off saves memory in training).",
    )
    use_liger_kernel: bool = Field(
        False,
        description="Patch the model with Liger kernels. Not supported by this runtime (refused "
        "when the Trainer starts).",
    )
    liger_kernel_config: dict[str, bool] | None = Field(
        None, description="Liger kernel switches (only with use_liger_kernel)."
    )
    parallelism_config: Any = Field(
        None,
        description="accelerate ParallelismConfig (tensor/context parallelism). Not supported "
        "by this runtime (refused when the Trainer starts): use fsdp for sharding.",
    )
    deepspeed: dict | str | None = Field(
        None,
        description="DeepSpeed config (dict, JSON string or path). Not supported by this runtime "
        "(refused when the Trainer starts): use fsdp for ZeRO-2/3-style sharding.",
    )
    debug: str | list[str] = Field(
        "",
        description="Debug features: 'underflow_overflow', 'tpu_metrics_debug' (space-separated). "
        "Not supported by this runtime (refused when the Trainer starts).",
    )
    skip_memory_metrics: bool = Field(
        True,
        description="Skip the memory-profiler metrics. False is not supported by this runtime "
        "(refused when the Trainer starts).",
    )

    # -- logging -----------------------------------------------------------------------------------
    logging_strategy: Literal["no", "steps", "epoch"] = Field(
        "steps", description="When to log loss and learning rate."
    )
    logging_steps: float = Field(
        500, description="Log every N optimizer steps; a value < 1 is a ratio of the total steps."
    )
    logging_first_step: bool = Field(False, description="Also log after the first step.")
    trackio_space_id: str | None = Field(
        None, description="Trackio: Hugging Face Space that hosts the dashboard."
    )
    trackio_bucket_id: str | None = Field(
        None, description="Trackio: storage bucket of the logged data."
    )
    trackio_static_space_id: str | None | Literal[False] = Field(  # noqa: RUF036
        None, description="Trackio: static Space linked from the model card (False: none)."
    )
    eval_use_gather_object: bool = Field(
        False,
        description="Gather non-tensor objects from every rank in evaluation. Not supported by "
        "this runtime (refused when the Trainer starts).",
    )

    # -- for training scripts (the Trainer does not read them, as in transformers) -----------------
    do_train: bool = Field(False, description="For scripts: run training.")
    do_eval: bool = Field(
        False, description="For scripts: run evaluation. Set when eval_strategy is not 'no'."
    )
    do_predict: bool = Field(False, description="For scripts: run prediction on the test set.")
    resume_from_checkpoint: str | None = Field(
        None,
        description="For scripts: checkpoint to pass to Trainer.train(resume_from_checkpoint=...).",
    )
    local_rank: int = Field(
        -1,
        description="Set by old launchers; use local_process_index for the local rank.",
    )

    # -- validators --------------------------------------------------------------------------------
    @field_validator(
        "optim", "lr_scheduler_type", "hub_strategy", "logging_strategy", mode="before"
    )
    @classmethod
    def _enum_value(cls, value: Any) -> Any:
        # transformers' str enums (OptimizerNames, SchedulerType, ...) are accepted by value.
        return value.value if isinstance(value, Enum) else value

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

    @field_validator("jit_stop_policy")
    @classmethod
    def _check_stop_policy(cls, value: str) -> str:
        if value not in STOP_POLICIES:
            raise ValueError(
                f"is not a stop policy: use one of {', '.join(STOP_POLICIES)} (or unset "
                "$PREEMPTIBLE_STOP_POLICY)"
            )
        return value

    @field_validator("max_steps")
    @classmethod
    def _check_max_steps(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be a positive step count, or -1 to train num_train_epochs")
        return value

    @field_validator("lr_scheduler_kwargs", mode="before")
    @classmethod
    def _parse_kwargs(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object ({exc})") from exc
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object, e.g. '{\"num_cycles\": 2}'")
        return value

    @field_validator("optim_args")
    @classmethod
    def _check_optim_args(cls, value: str | None) -> str | None:
        if not value:
            return value
        for item in value.replace(" ", "").split(","):
            if item.count("=") != 1 or not item.split("=")[0]:
                raise ValueError(
                    f"{item!r} is not 'key=value'; write e.g. 'momentum=0.9,nesterov=True'"
                )
        return value

    @field_validator("deepspeed", mode="before")
    @classmethod
    def _parse_deepspeed(cls, value: Any) -> Any:
        # A JSON string becomes a dict (as in transformers); other strings are config paths.
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object ({exc})") from exc
        return value

    @field_validator("debug", mode="before")
    @classmethod
    def _parse_debug(cls, value: Any) -> Any:
        if value is None:
            return []
        items = value.split() if isinstance(value, str) else list(value)
        names = [str(getattr(item, "value", item)) for item in items]
        unknown = [n for n in names if n not in DEBUG_OPTIONS]
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; use any of {', '.join(DEBUG_OPTIONS)}")
        return names

    @model_validator(mode="after")
    def _cross_checks(self) -> TrainingArgumentsSchema:
        if not self.output_dir:
            raise ValueError(
                "output_dir is required: pass output_dir='...' (a path or fsspec URL) or set "
                f"${ENV_OUTPUT_DIR}"
            )
        if self.output_dir.startswith("~"):
            self.__dict__["output_dir"] = os.path.expanduser(self.output_dir)
        if self.lr_scheduler_type in METRIC_SCHEDULERS:
            if self.eval_strategy == "no":
                raise ValueError(
                    f"lr_scheduler_type={self.lr_scheduler_type!r} follows an evaluation metric: "
                    "set eval_strategy to 'steps' or 'epoch'"
                )
            if self.metric_for_best_model is None:
                self.__dict__["metric_for_best_model"] = "loss"
                if self.greater_is_better is None:
                    self.__dict__["greater_is_better"] = False
        if self.eval_strategy != "no" and not self.do_eval:
            self.__dict__["do_eval"] = True
        if self.use_cpu and self.dataloader_pin_memory:
            self.__dict__["dataloader_pin_memory"] = False
        return self


# ------------------------------------------------------------------------------------------------
# the dataclass
# ------------------------------------------------------------------------------------------------

# Type hints HfArgumentParser reads, where the schema's annotation is not one it can parse (it
# takes one type per argument; dict-valued fields are read as JSON strings, as in transformers).
_PARSER_TYPES: dict[str, Any] = {
    "accelerator_config": dict | str | None,
    "fsdp": list[str] | str | None,
    "fsdp_config": dict[str, Any] | str | None,
    "report_to": None | str | list[str],
}
# Defaults shown to dataclasses / HfArgumentParser where the schema fills in a derived value.
_FIELD_DEFAULTS: dict[str, Any] = {"accelerator_config": None, "fsdp": None}
# Fields whose default the operator's environment decides (docs/trainer.md, "Arguments"): every
# schema default_factory that reads os.environ. tests/unit/runtime/test_env_defaults.py checks
# that no other default changes with the environment.
ENV_DEFAULTS: dict[str, EnvDefault] = {
    "output_dir": EnvDefault(_default_output_dir, f"${ENV_OUTPUT_DIR}, else required"),
    "enable_jit_checkpoint": EnvDefault(
        _default_jit, f"True when ${ENV_OUTPUT_DIR} is set, else False"
    ),
    "jit_stop_policy": EnvDefault(_default_stop_policy, f"${ENV_STOP_POLICY}, else 'finish_step'"),
}
_FLAG = "_preemptible_validated"
_SCHEMA_FIELDS: tuple[str, ...] = tuple(TrainingArgumentsSchema.model_fields)


class UnknownArgumentError(ConfigurationError, TypeError):
    """An argument TrainingArguments does not have (a TypeError too, as a dataclass raises)."""


def _dataclass_field(name: str) -> tuple[str, Any, dataclasses.Field[Any]]:
    info = TrainingArgumentsSchema.model_fields[name]
    metadata = {"help": info.description or ""}
    if name in _FIELD_DEFAULTS:
        spec = dataclasses.field(default=_FIELD_DEFAULTS[name], metadata=metadata)
    elif name in ENV_DEFAULTS:
        spec = dataclasses.field(default=ENV_DEFAULTS[name], metadata=metadata)
    elif info.default_factory is not None:
        spec = dataclasses.field(default_factory=info.default_factory, metadata=metadata)
    else:
        spec = dataclasses.field(default=info.default, metadata=metadata)
    return name, _PARSER_TYPES.get(name, info.annotation), spec


def _field_values(obj: Any) -> dict[str, Any]:
    return {name: obj.__dict__[name] for name in _SCHEMA_FIELDS if name in obj.__dict__}


def _validate(obj: Any, values: dict[str, Any]) -> None:
    """Validate ``values`` and store the normalised fields on ``obj``."""
    values = _resolve_env_defaults(values)
    try:
        model = TrainingArgumentsSchema(**values)
    except ValidationError as exc:
        raise ConfigurationError(_format_errors(exc, values)) from None
    for name in _SCHEMA_FIELDS:
        obj.__dict__[name] = getattr(model, name)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    to_json = getattr(value, "to_json", None) or getattr(value, "to_dict", None)
    if callable(to_json) and not isinstance(value, (dict, list, str)):
        return to_json()
    return to_jsonable_python(value, fallback=str)


class _TrainingArgumentsMethods:
    """Behaviour of :class:`TrainingArguments` (transformers' members, same signatures)."""

    # -- validation ------------------------------------------------------------------------------
    def __post_init__(self) -> None:
        _validate(self, _field_values(self))
        self.__dict__[_FLAG] = True

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _SCHEMA_FIELDS or not self.__dict__.get(_FLAG):
            object.__setattr__(self, name, value)
            return
        self._update(**{name: value})

    def _update(self, **changes: Any) -> Any:
        """Set several fields at once, validated together (the set_* helpers use it)."""
        if not self.__dict__.get(_FLAG):
            for name, value in changes.items():
                object.__setattr__(self, name, value)
            return self
        _validate(self, {**_field_values(self), **changes})
        return self

    def __str__(self) -> str:
        values = dataclasses.asdict(self)  # type: ignore[call-overload]
        shown = {k: (f"<{k.upper()}>" if k.endswith("_token") else v) for k, v in values.items()}
        body = "".join(f"{k}={v},\n" for k, v in sorted(shown.items()))
        return f"{type(self).__name__}(\n{body})"

    __repr__ = __str__

    # -- batch sizes -----------------------------------------------------------------------------
    @property
    def train_batch_size(self) -> int:
        """Training batch size of this process: per_device_train_batch_size * max(1, n_gpu), which
        is per_device_train_batch_size here (n_gpu is at most 1: no nn.DataParallel)."""
        return self.per_device_train_batch_size  # type: ignore[attr-defined]

    @property
    def eval_batch_size(self) -> int:
        """Evaluation batch size of this process: per_device_eval_batch_size (see
        train_batch_size)."""
        return self.per_device_eval_batch_size  # type: ignore[attr-defined]

    @property
    def ddp_timeout_delta(self) -> timedelta:
        return timedelta(seconds=self.ddp_timeout)  # type: ignore[attr-defined]

    # -- processes and devices (from the launcher's environment; torch imported lazily) ----------
    @property
    def world_size(self) -> int:
        """Number of processes training together."""
        dist = _initialized_dist()
        if dist is not None:
            return int(dist.get_world_size())
        return _env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        """Global rank of this process."""
        dist = _initialized_dist()
        if dist is not None:
            return int(dist.get_rank())
        return _env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its node."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def device(self) -> Any:
        """The ``torch.device`` this process trains on."""
        import torch

        if self.use_cpu:  # type: ignore[attr-defined]
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_process_index % torch.cuda.device_count())
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on an accelerator, 0 on CPU (one device per process: this
        runtime never uses nn.DataParallel)."""
        return 0 if self.device.type == "cpu" else 1

    @property
    def parallel_mode(self) -> ParallelMode:
        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def place_model_on_device(self) -> bool | None:
        return None

    @property
    def should_log(self) -> bool:
        """Whether this process logs (main process of each node with log_on_each_node)."""
        if self.log_on_each_node:  # type: ignore[attr-defined]
            return self.local_process_index == 0
        return self.process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints (each node's main one with save_on_each_node)."""
        if self.save_on_each_node:  # type: ignore[attr-defined]
            return self.local_process_index == 0
        return self.process_index == 0

    def get_process_log_level(self) -> int:
        """Log level of this process: log_level on the main process(es), log_level_replica on the
        others; 'passive' keeps the current level of the runtime's logger."""
        current = logging.getLogger("trainer_runtime").getEffectiveLevel()
        name = self.log_level if self.should_log else self.log_level_replica  # type: ignore[attr-defined]
        level = LOG_LEVELS[name]
        return current if level is None else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the block on the main process (of each node with ``local``) first, the others wait
        at a barrier until it is done (e.g. ``datasets.map`` writes its cache once)."""
        if self.world_size <= 1:
            yield
            return
        from accelerate import PartialState

        # Started with this run's backend and timeout; the Trainer's Accelerator reuses it.
        kwargs: dict[str, Any] = {"cpu": self.use_cpu, "timeout": self.ddp_timeout_delta}  # type: ignore[attr-defined]
        if self.ddp_backend is not None:  # type: ignore[attr-defined]
            kwargs["backend"] = self.ddp_backend  # type: ignore[attr-defined]
        state = PartialState(**kwargs)
        first = state.local_main_process_first() if local else state.main_process_first()
        logger.debug(
            "%d: %s first (%s)", self.process_index, "local main" if local else "main", desc
        )
        with first:
            yield

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warm-up steps: warmup_steps when >= 1, else that ratio of the training steps (ceil)."""
        warmup = self.warmup_steps  # type: ignore[attr-defined]
        return int(warmup) if warmup >= 1 else math.ceil(num_training_steps * warmup)

    def steps_from_ratio(self, value: float, max_steps: int) -> int:
        """Resolve a save/logging interval that may be a ratio of ``max_steps``."""
        return int(value) if value >= 1 else max(1, math.ceil(value * max_steps))

    @property
    def report_to_list(self) -> list[str]:
        """``report_to`` as a list (empty for none)."""
        from trainer_runtime.features.trackers import normalize_report_to

        return normalize_report_to(self.report_to)  # type: ignore[attr-defined]

    # -- serialisation ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the init fields (tokens replaced by ``<NAME>``)."""
        out: dict[str, Any] = {}
        for spec in dataclasses.fields(self):  # type: ignore[arg-type]
            if not spec.init:
                continue
            value = getattr(self, spec.name)
            out[spec.name] = f"<{spec.name.upper()}>" if spec.name.endswith("_token") else value
            out[spec.name] = _jsonable(out[spec.name])
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """Flat dict of bool/int/float/str values (others as str), for TensorBoard hparams."""
        values = {
            **self.to_dict(),
            "train_batch_size": self.train_batch_size,
            "eval_batch_size": self.eval_batch_size,
        }
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in values.items()}

    # -- grouped setters (transformers' signatures; each validates its fields together) ----------
    def set_training(
        self,
        learning_rate: float = 5e-5,
        batch_size: int = 8,
        weight_decay: float = 0,
        num_epochs: float = 3,
        max_steps: int = -1,
        gradient_accumulation_steps: int = 1,
        seed: int = 42,
        activation_checkpointing: bool = False,
        gradient_checkpointing: bool | None = None,
    ) -> Any:
        if gradient_checkpointing is not None:
            import warnings

            warnings.warn(
                "gradient_checkpointing is deprecated: use activation_checkpointing",
                FutureWarning,
                stacklevel=2,
            )
            activation_checkpointing = gradient_checkpointing
        return self._update(
            do_train=True,
            learning_rate=learning_rate,
            per_device_train_batch_size=batch_size,
            weight_decay=weight_decay,
            num_train_epochs=num_epochs,
            max_steps=max_steps,
            gradient_accumulation_steps=gradient_accumulation_steps,
            seed=seed,
            activation_checkpointing=activation_checkpointing,
        )

    def set_evaluate(
        self,
        strategy: str = "no",
        steps: int = 500,
        batch_size: int = 8,
        accumulation_steps: int | None = None,
        delay: float | None = None,
        loss_only: bool = False,
    ) -> Any:
        strategy = getattr(strategy, "value", strategy)
        if strategy == "steps" and steps == 0:
            raise ConfigurationError("set_evaluate(strategy='steps') needs steps > 0")
        return self._update(
            eval_strategy=strategy,
            do_eval=strategy != "no",
            eval_steps=steps,
            per_device_eval_batch_size=batch_size,
            eval_accumulation_steps=accumulation_steps,
            eval_delay=0 if delay is None else delay,
            prediction_loss_only=loss_only,
        )

    def set_testing(self, batch_size: int = 8, loss_only: bool = False) -> Any:
        return self._update(
            do_predict=True, per_device_eval_batch_size=batch_size, prediction_loss_only=loss_only
        )

    def set_save(
        self,
        strategy: str = "steps",
        steps: int = 500,
        total_limit: int | None = None,
        on_each_node: bool = False,
    ) -> Any:
        strategy = getattr(strategy, "value", strategy)
        if strategy == "steps" and steps == 0:
            raise ConfigurationError("set_save(strategy='steps') needs steps > 0")
        return self._update(
            save_strategy=strategy,
            save_steps=steps,
            save_total_limit=total_limit,
            save_on_each_node=on_each_node,
        )

    def set_logging(
        self,
        strategy: str = "steps",
        steps: int = 500,
        report_to: str | list[str] = "none",
        level: str = "passive",
        first_step: bool = False,
        nan_inf_filter: bool = False,
        on_each_node: bool = False,
        replica_level: str = "passive",
    ) -> Any:
        strategy = getattr(strategy, "value", strategy)
        if strategy == "steps" and steps == 0:
            raise ConfigurationError("set_logging(strategy='steps') needs steps > 0")
        return self._update(
            logging_strategy=strategy,
            logging_steps=steps,
            report_to=report_to,
            log_level=level,
            logging_first_step=first_step,
            logging_nan_inf_filter=nan_inf_filter,
            log_on_each_node=on_each_node,
            log_level_replica=replica_level,
        )

    def set_push_to_hub(
        self,
        model_id: str,
        strategy: str = "every_save",
        token: str | None = None,
        private_repo: bool | None = None,
        always_push: bool = False,
        revision: str | None = None,
    ) -> Any:
        return self._update(
            push_to_hub=True,
            hub_model_id=model_id,
            hub_strategy=strategy,
            hub_token=token,
            hub_private_repo=private_repo,
            hub_always_push=always_push,
            hub_revision=revision,
        )

    def set_optimizer(
        self,
        name: str = "adamw_torch",
        learning_rate: float = 5e-5,
        weight_decay: float = 0,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        args: str | None = None,
    ) -> Any:
        return self._update(
            optim=name,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            adam_beta1=beta1,
            adam_beta2=beta2,
            adam_epsilon=epsilon,
            optim_args=args,
        )

    def set_lr_scheduler(
        self,
        name: str = "linear",
        num_epochs: float = 3.0,
        max_steps: int = -1,
        warmup_steps: float = 0,
    ) -> Any:
        return self._update(
            lr_scheduler_type=name,
            num_train_epochs=num_epochs,
            max_steps=max_steps,
            warmup_steps=warmup_steps,
        )

    def set_dataloader(
        self,
        train_batch_size: int = 8,
        eval_batch_size: int = 8,
        drop_last: bool = False,
        num_workers: int = 0,
        pin_memory: bool = True,
        persistent_workers: bool = False,
        prefetch_factor: int | None = None,
        multiprocessing_context: str | None = None,
        in_order: bool = True,
        auto_find_batch_size: bool = False,
        ignore_data_skip: bool = False,
        sampler_seed: int | None = None,
    ) -> Any:
        return self._update(
            per_device_train_batch_size=train_batch_size,
            per_device_eval_batch_size=eval_batch_size,
            dataloader_drop_last=drop_last,
            dataloader_num_workers=num_workers,
            dataloader_pin_memory=pin_memory,
            dataloader_persistent_workers=persistent_workers,
            dataloader_prefetch_factor=prefetch_factor,
            dataloader_multiprocessing_context=multiprocessing_context,
            dataloader_in_order=in_order,
            auto_find_batch_size=auto_find_batch_size,
            ignore_data_skip=ignore_data_skip,
            data_seed=sampler_seed,
        )


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, "") or default)
    except ValueError:
        return default


def _initialized_dist() -> Any:
    """``torch.distributed`` when torch is already imported and a process group exists."""
    import sys

    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _build_dataclass() -> type:
    names = ["output_dir", *(n for n in _SCHEMA_FIELDS if n != "output_dir")]
    cls = dataclasses.make_dataclass(
        "TrainingArguments",
        [_dataclass_field(name) for name in names],
        bases=(_TrainingArgumentsMethods,),
        namespace={
            "__module__": __name__,
            "__doc__": (
                "Arguments of :class:`trainer_runtime.Trainer`: every field of transformers "
                "5.x's TrainingArguments (same names, types and defaults) plus this runtime's "
                "own (enable_jit_checkpoint, train_sampling_strategy, ...). A dataclass: works "
                "with HfArgumentParser and dataclasses.replace/asdict. Invalid values raise "
                "ConfigurationError naming the field, the value and the fix; assignments are "
                "validated too."
            ),
        },
        repr=False,
    )
    generated_init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in cls.__dataclass_fields__]
        if unknown:
            raise UnknownArgumentError(_unknown_arguments(unknown))
        generated_init(self, *args, **kwargs)

    __init__.__signature__ = inspect.signature(generated_init)  # type: ignore[attr-defined]
    __init__.__doc__ = generated_init.__doc__
    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def _unknown_arguments(names: list[str]) -> str:
    lines = [f"invalid TrainingArguments ({len(names)} error(s)):"]
    for name in names:
        close = difflib.get_close_matches(name, _SCHEMA_FIELDS, n=1)
        hint = f"did you mean {close[0]!r}?" if close else "remove it"
        lines.append(f"  - {name}: unknown argument; {hint}")
    return "\n".join(lines)


TrainingArguments = _build_dataclass()


# ------------------------------------------------------------------------------------------------
# fields accepted for compatibility that this runtime cannot honour
# ------------------------------------------------------------------------------------------------


def check_runtime_support(args: Any) -> None:
    """Refuse, when the Trainer starts, the transformers features this runtime does not have.

    They are accepted at parse time (as transformers does) so that scripts and config files
    written for transformers load; a run that would rely on one fails here with the reason and
    what to use instead, never silently without it.
    """
    problems: list[str] = []
    if getattr(args, "deepspeed", None):
        problems.append(
            "deepspeed: DeepSpeed is not supported by this runtime; use fsdp='full_shard' "
            "(ZeRO-3) or fsdp='shard_grad_op' (ZeRO-2) instead"
        )
    if getattr(args, "parallelism_config", None) is not None:
        problems.append(
            "parallelism_config: tensor/context parallelism is not supported by this runtime; "
            "leave it unset (use fsdp for sharding)"
        )
    if getattr(args, "use_liger_kernel", False):
        problems.append(
            "use_liger_kernel=True: Liger kernels are not applied by this runtime; set it to "
            "False (or patch the model with liger_kernel yourself before passing it)"
        )
    # No Hub is reachable: push_to_hub needs hub_model_id to be an fsspec URL (features/hub.py).
    from trainer_runtime.features.hub import push_target_problem

    hub_problem = push_target_problem(
        bool(getattr(args, "push_to_hub", False)), getattr(args, "hub_model_id", None)
    )
    if hub_problem:
        problems.append(hub_problem)
    if getattr(args, "auto_find_batch_size", False):
        problems.append(
            "auto_find_batch_size=True: retrying with smaller batches after out-of-memory errors "
            "is not supported by this runtime; set per_device_train_batch_size yourself"
        )
    if getattr(args, "debug", None):
        problems.append(
            f"debug={args.debug!r}: the debug features are not supported by this runtime; "
            "leave debug empty"
        )
    if not getattr(args, "skip_memory_metrics", True):
        problems.append(
            "skip_memory_metrics=False: memory-profiler metrics are not reported by this "
            "runtime; leave skip_memory_metrics=True"
        )
    if getattr(args, "eval_use_gather_object", False):
        problems.append(
            "eval_use_gather_object=True: gathering non-tensor objects in evaluation is not "
            "supported by this runtime; return tensors from the model"
        )
    if problems:
        raise ConfigurationError(
            "TrainingArguments asks for features this runtime does not have:\n  - "
            + "\n  - ".join(problems)
        )


# ------------------------------------------------------------------------------------------------
# error messages
# ------------------------------------------------------------------------------------------------


def _format_errors(exc: ValidationError, data: dict[str, Any]) -> str:
    lines = [f"invalid TrainingArguments ({exc.error_count()} error(s)):"]
    model = TrainingArgumentsSchema
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
