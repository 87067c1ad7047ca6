"""A stock TRL script (SFTTrainer on a tiny GPT-2 from a config): it imports only TRL and
transformers; the tests run it unmodified under ``python -m trainer_runtime.hf.run``."""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import datasets
from transformers import TrainerCallback
from trl import SFTConfig, SFTTrainer

from tests.transformers import models


class SleepCallback(TrainerCallback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        print(f"STEP {state.global_step}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--final-dir", default=None)
    a = p.parse_args()
    tok = models.tokenizer()
    model = models.gpt2(tok, seed=0)
    ds = datasets.Dataset.from_dict({"text": models.corpus(32)})
    cfg = SFTConfig(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_steps=4,
        logging_steps=1,
        report_to="none",
        seed=7,
        use_cpu=True,
        disable_tqdm=True,
        max_length=32,
        packing=False,
        dataset_text_field="text",
    )
    trainer = SFTTrainer(
        model=model,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[SleepCallback(a.step_sleep)] if a.step_sleep else None,
    )
    trainer.train()
    if a.final_dir:
        trainer.save_model(a.final_dir)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
