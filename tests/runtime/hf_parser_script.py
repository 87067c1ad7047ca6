"""A training script shaped like transformers' examples (run_clm.py), with only the import changed.

Its arguments come from ``HfArgumentParser((ModelArguments, DataTrainingArguments,
TrainingArguments)).parse_args_into_dataclasses()``, so every ``TrainingArguments`` field is a
command-line option (``--max_steps``, ``--save_steps``, ``--dataloader_num_workers``, ...) and
the defaults the operator's environment decides (``output_dir``, ``enable_jit_checkpoint``,
``jit_stop_policy``) come from ``$PREEMPTIBLE_*`` exactly as when the arguments are built
directly. ``HfArgumentParser`` is transformers' own (trainer_runtime does not export one).

The model is a tiny GPT-2 built from a config (tests/transformers/models.py: nothing is
downloaded). ``--step_sleep`` (its own dataclass) only slows each optimizer step so a test can
signal it mid-run; every step prints ``STEP n``, the end prints ``FINISHED``.

    PREEMPTIBLE_OUTPUT_DIR=/tmp/out python -P tests/runtime/hf_parser_script.py \\
        --max_steps 40 --save_steps 10 --step_sleep 0.2 --dataloader_num_workers 2 \\
        --per_device_train_batch_size 4 --use_cpu --report_to none
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

# The tiny model and tokenizer builders live in the test tree (nothing is downloaded). Appended,
# not prepended: the repository's operator/ folder must not shadow the stdlib module.
sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from transformers import DataCollatorForLanguageModeling, HfArgumentParser

from tests.transformers import models
from trainer_runtime import Trainer, TrainerCallback, TrainingArguments


@dataclass
class ModelArguments:
    model_seed: int = field(default=0, metadata={"help": "Seed of the tiny GPT-2's weights."})


@dataclass
class DataTrainingArguments:
    num_samples: int = field(default=64, metadata={"help": "Sentences in the training set."})
    max_seq_length: int = field(default=32, metadata={"help": "Tokenizer truncation length."})


@dataclass
class PacingArguments:
    step_sleep: float = field(
        default=0.0, metadata={"help": "Seconds each optimizer step lasts at least (for tests)."}
    )


class StepCallback(TrainerCallback):
    """Prints ``STEP n`` after each optimizer step, which lasts at least ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        if self.seconds:
            time.sleep(self.seconds)
        print(f"STEP {state.global_step}", flush=True)


def main() -> None:
    parser = HfArgumentParser(
        (ModelArguments, DataTrainingArguments, PacingArguments, TrainingArguments)
    )
    model_args, data_args, pacing, training_args = parser.parse_args_into_dataclasses()
    print(
        f"ARGS enable_jit_checkpoint={training_args.enable_jit_checkpoint} "
        f"output_dir={training_args.output_dir} "
        f"dataloader_num_workers={training_args.dataloader_num_workers}",
        flush=True,
    )

    tok = models.tokenizer(model_max_length=data_args.max_seq_length)
    model = models.gpt2(tok, seed=model_args.model_seed)
    train_dataset = models.causal_lm_dataset(tok, n=data_args.num_samples).remove_columns(["text"])

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[StepCallback(pacing.step_sleep)],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
