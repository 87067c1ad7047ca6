"""A stock-shaped transformers script with DataLoader workers, for the SIGTERM x workers matrix.

It builds a plain ``transformers.Trainer`` (no line of ours: run it under ``python -m
trainer_runtime.hf.run`` or ``trainer-runtime launch --transformers``) on the toy's tiny MLP and
synthetic set (a pure function of the seed, deterministic in every process and worker), so each
case stays short. ``--step-sleep`` makes each step slow enough to signal it mid-run; each step
prints ``STEP n`` (rank 0) for the test to wait on. ``--final-dir``: rank 0 saves the final model.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from trainer_runtime.toy import ToyDataset, ToyModel


class StepCallback(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        if args.process_index == 0:
            print(f"STEP {state.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--dataloader-num-workers", type=int, default=0)
    p.add_argument("--dataloader-persistent-workers", action="store_true")
    p.add_argument("--final-dir", default=None)
    a = p.parse_args()

    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=a.save_steps,
        logging_steps=4,
        report_to="none",
        seed=7,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=a.dataloader_num_workers,
        dataloader_persistent_workers=a.dataloader_persistent_workers,
        dataloader_pin_memory=True,
    )
    torch.manual_seed(7)  # the model's initial weights: the same in every run
    trainer = Trainer(
        model=ToyModel(),
        args=args,
        train_dataset=ToyDataset(512, seed=7),
        callbacks=[StepCallback(a.step_sleep)],
    )
    trainer.train()
    if a.final_dir and trainer.args.process_index == 0:
        trainer.save_model(a.final_dir)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
