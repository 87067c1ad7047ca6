"""The pieces every conformance script shares: the Trainer API it runs against and the
examples' argument skeleton (``ModelArguments`` / ``DataTrainingArguments``)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Api:
    """What a script would import from ``transformers``'s Trainer API: transformers' or ours.

    ``Seq2SeqTrainer`` / ``Seq2SeqTrainingArguments`` are None where the implementation has none.
    """

    name: str
    Trainer: Any
    TrainingArguments: Any
    TrainerCallback: Any
    get_last_checkpoint: Any
    set_seed: Any
    Seq2SeqTrainer: Any = None
    Seq2SeqTrainingArguments: Any = None


def transformers_api() -> Api:
    import transformers
    from transformers.trainer_utils import get_last_checkpoint

    return Api(
        name="transformers",
        Trainer=transformers.Trainer,
        TrainingArguments=transformers.TrainingArguments,
        TrainerCallback=transformers.TrainerCallback,
        get_last_checkpoint=get_last_checkpoint,
        set_seed=transformers.set_seed,
        Seq2SeqTrainer=transformers.Seq2SeqTrainer,
        Seq2SeqTrainingArguments=transformers.Seq2SeqTrainingArguments,
    )


def ours_api(trainer: Any = None) -> Api:
    """Our API; ``trainer`` replaces ``trainer_runtime.Trainer`` (the suite's stand-ins for
    methods another change adds, see test_scripts.py)."""
    import trainer_runtime

    return Api(
        name="ours",
        Trainer=trainer or trainer_runtime.Trainer,
        TrainingArguments=trainer_runtime.TrainingArguments,
        TrainerCallback=trainer_runtime.TrainerCallback,
        get_last_checkpoint=trainer_runtime.get_last_checkpoint,
        set_seed=trainer_runtime.set_seed,
        Seq2SeqTrainer=getattr(trainer_runtime, "Seq2SeqTrainer", None),
        Seq2SeqTrainingArguments=getattr(trainer_runtime, "Seq2SeqTrainingArguments", None),
    )


@dataclass
class ModelArguments:
    """Which model to start from (a tiny builder of tests/transformers/models.py, seeded)."""

    model_name_or_path: str = field(default="tiny", metadata={"help": "builder name"})
    model_seed: int = field(default=0, metadata={"help": "seed of the initial weights"})


@dataclass
class DataTrainingArguments:
    """What data to train and evaluate on (in-memory synthetic corpora)."""

    num_train_examples: int = field(default=24)
    num_eval_examples: int = field(default=8)
    max_seq_length: int = field(default=16)
    block_size: int = field(default=8, metadata={"help": "causal LM: length of grouped blocks"})
    max_target_length: int = field(default=12)
    pad_to_max_length: bool = field(default=False)
    mlm_seed: int | None = field(default=None, metadata={"help": "masked LM: the masks' seed"})


def parse(argv: list[str], api: Api, args_cls: Any = None) -> tuple[Any, Any, Any]:
    """The examples' ``HfArgumentParser((ModelArguments, DataTrainingArguments,
    TrainingArguments)).parse_args_into_dataclasses()``."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        (ModelArguments, DataTrainingArguments, args_cls or api.TrainingArguments)
    )
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    return model_args, data_args, training_args


def detect_last_checkpoint(training_args: Any, api: Api) -> str | None:
    """The examples' "Detecting last checkpoint" block."""
    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = api.get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info("Checkpoint detected, resuming training at %s.", last_checkpoint)
    return last_checkpoint


def train_and_save(
    trainer: Any, training_args: Any, last_checkpoint: str | None, num_train: int
) -> dict[str, Any]:
    """The examples' training block: resume, save the model, log/save metrics and state."""
    checkpoint = training_args.resume_from_checkpoint or last_checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model()
    metrics = dict(train_result.metrics)
    metrics["train_samples"] = num_train
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    return metrics


def evaluate(trainer: Any, num_eval: int, **kwargs: Any) -> dict[str, Any]:
    """The examples' evaluation block."""
    metrics = dict(trainer.evaluate(**kwargs))
    metrics["eval_samples"] = num_eval
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    return metrics


def predict(trainer: Any, dataset: Any, **kwargs: Any) -> Any:
    """The examples' predict block; returns the PredictionOutput."""
    output = trainer.predict(dataset, metric_key_prefix="predict", **kwargs)
    trainer.log_metrics("predict", output.metrics)
    trainer.save_metrics("predict", output.metrics)
    return output
