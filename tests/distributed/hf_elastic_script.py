"""A stock transformers training script (tiny GPT-2 from a config, dropout off) that records which
dataset rows each rank trained on in each optimizer step, for the elastic test.

It imports only transformers (and the test tree's model builders); the test runs it unmodified
under ``python -m trainer_runtime.hf.run``. Recording: every row carries its index (``idx``); the
collator takes it out before the language-modelling collator sees the row, and a callback writes
the indices collated since the previous step's end as one JSON line per step
(``{"step": n, "indices": [...]}``) to ``<record>/rank<k>.jsonl``. transformers fetches a step's
micro-batches at its start (``get_batch_samples``), after the previous step's end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# Appended, not prepended: the repository's operator/ folder must not shadow the stdlib module.
sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from transformers import (
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from tests.transformers import models

# The dataset rows trained on since the last optimizer step ended (this rank's).
TRAINED: list[int] = []


class RecordingCollator:
    """The language-modelling collator; the rows' ``idx`` ride along as a tensor."""

    def __init__(self, inner: DataCollatorForLanguageModeling) -> None:
        self.inner = inner

    def __call__(self, features: list[dict]) -> dict:
        rows = [dict(feature) for feature in features]
        idx = [int(row.pop("idx")) for row in rows]
        batch = self.inner(rows)
        batch["idx"] = torch.tensor(idx)
        return batch


class RecordingTrainer(Trainer):
    """Takes each micro-batch's ``idx`` out as it trains on it (the DataLoader collates ahead)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        TRAINED.extend(inputs.pop("idx").tolist())
        return super().training_step(model, inputs, num_items_in_batch)


class StepRecorder(TrainerCallback):
    """One JSON line per optimizer step with the rows collated for it; ``sleep``: each step lasts
    at least that long (so a test can signal it at a known step)."""

    def __init__(self, path: str, sleep: float) -> None:
        self.path = path
        self.sleep = sleep

    def on_step_end(self, args, state, control, **kwargs):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, "indices": TRAINED}))
            f.write("\n")
        TRAINED.clear()
        if self.sleep:
            time.sleep(self.sleep)
        print(f"STEP {state.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--record", required=True, help="folder of the per-rank step records")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--num-samples", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args()

    tok = models.tokenizer()
    model = models.gpt2(tok, seed=0, dropout=0.0)
    ds = models.causal_lm_dataset(tok, n=a.num_samples).remove_columns(["text"])
    ds = ds.add_column("idx", list(range(len(ds))))
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=a.batch_size,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=a.save_steps,
        logging_steps=1,
        report_to="none",
        seed=7,
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,  # the collator takes idx out itself
        dataloader_num_workers=0,  # the collator's record stays in this process
    )
    collator = RecordingCollator(DataCollatorForLanguageModeling(tok, mlm=False))
    os.makedirs(a.record, exist_ok=True)
    path = os.path.join(a.record, f"rank{args.process_index}.jsonl")
    # Passed to the constructor: it runs before the callback the runtime adds, which ends the
    # process at a JIT stop's step end.
    trainer = RecordingTrainer(
        model=model,
        args=args,
        train_dataset=ds,
        data_collator=collator,
        callbacks=[StepRecorder(path, a.step_sleep)],
    )
    trainer.train()
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
