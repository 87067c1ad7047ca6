"""A stock transformers training script (tiny GPT-2 from a config), as a user would write it.

It imports only ``transformers``: the tests run it unmodified under ``python -m
trainer_runtime.hf.run`` (no line changed), or with ``--attach`` (the one-line integration).
``--step-sleep`` / ``--save-sleep`` / ``--eval-sleep`` / ``--micro-sleep`` only slow it down so a
test can signal it mid-step, mid-save, mid-evaluation or between micro-batches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The tiny model and tokenizer builders live in the test tree (nothing is downloaded). Appended,
# not prepended: the repository's operator/ folder must not shadow the stdlib module.
sys.path.append(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from transformers import (
    DataCollatorForLanguageModeling,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from tests.transformers import models


class SleepCallback(TrainerCallback):
    """Makes each optimizer step last at least ``seconds`` (a slow model, for signal timing)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        print(f"STEP {state.global_step}", flush=True)


class EvalCallback(TrainerCallback):
    """Says when an evaluation ended; ``seconds``: each evaluation batch lasts at least that."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_prediction_step(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        print(f"EVAL BATCH {state.global_step}", flush=True)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        print(f"EVALUATED {state.global_step} {metrics.get('eval_loss')}", flush=True)


class MicroBatchCallback(TrainerCallback):
    """Makes each micro-batch of a gradient-accumulation step but its last last ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_substep_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)
        print(f"SUBSTEP {state.global_step + 1}", flush=True)


class EndCallback(TrainerCallback):
    """Says when transformers' end of training reached the callbacks."""

    def on_train_end(self, args, state, control, **kwargs):
        print("TRAIN END", flush=True)


class SlowSaveTrainer(Trainer):
    """A user subclass whose model save takes ``save_sleep`` seconds after the weights are on disk
    (a large model on a slow volume)."""

    save_sleep = 0.0
    fail_save_rank = -1

    def save_model(self, output_dir=None, _internal_call=False):
        if _internal_call and self.args.process_index == self.fail_save_rank:
            raise RuntimeError(f"disk full on purpose, rank {self.args.process_index}")
        super().save_model(output_dir, _internal_call=_internal_call)
        if _internal_call and self.save_sleep:
            print(f"SAVING {output_dir}", flush=True)
            time.sleep(self.save_sleep)

    def _load_best_model(self):
        print(f"LOADING BEST {self.state.best_model_checkpoint}", flush=True)
        super()._load_best_model()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--save-steps", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--save-sleep", type=float, default=0.0)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument(
        "--best",
        action="store_true",
        help="evaluate every --save-steps, load_best_model_at_end=True (with --save-total-limit 1)",
    )
    p.add_argument(
        "--greater-is-better",
        action="store_true",
        help="with --best: the highest eval_loss is the best (the first evaluation, not the last)",
    )
    p.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps")
    p.add_argument("--eval-sleep", type=float, default=0.0, help="each evaluation batch sleeps")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--micro-sleep", type=float, default=0.0, help="each micro-batch sleeps")
    p.add_argument("--fail-save-rank", type=int, default=-1, help="this rank's saves raise")
    p.add_argument(
        "--linger", type=float, default=0.0, help="the failing rank stays alive this long after"
    )
    p.add_argument("--attach", action="store_true", help="the one-line integration")
    p.add_argument("--final-dir", default=None)
    a = p.parse_args()

    tok = models.tokenizer()
    model = models.gpt2(tok, seed=0)
    ds = models.causal_lm_dataset(tok, n=32).remove_columns(["text"])
    best = (
        {"eval_strategy": "steps", "eval_steps": a.save_steps, "load_best_model_at_end": True}
        if a.best
        else {}
    )
    if a.best and a.greater_is_better:
        best.update(metric_for_best_model="eval_loss", greater_is_better=True)
    if a.eval_steps:
        best.update(eval_strategy="steps", eval_steps=a.eval_steps)
    evaluating = bool(a.best or a.eval_steps)
    args = TrainingArguments(
        output_dir=a.output_dir,
        max_steps=a.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=a.save_steps,
        save_total_limit=a.save_total_limit,
        logging_steps=1,
        report_to="none",
        seed=7,
        gradient_accumulation_steps=a.grad_accum,
        use_cpu=True,
        disable_tqdm=True,
        **best,
    )
    SlowSaveTrainer.save_sleep = a.save_sleep
    SlowSaveTrainer.fail_save_rank = a.fail_save_rank
    trainer = SlowSaveTrainer(
        model=model,
        args=args,
        train_dataset=ds,
        eval_dataset=ds if evaluating else None,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[
            EndCallback(),
            *([SleepCallback(a.step_sleep)] if a.step_sleep else []),
            *([EvalCallback(a.eval_sleep)] if evaluating else []),
            *([MicroBatchCallback(a.micro_sleep)] if a.micro_sleep else []),
        ],
    )
    if a.attach:
        import trainer_runtime

        trainer_runtime.attach_preemptible(trainer)
    try:
        trainer.train()
    except Exception as exc:
        if a.linger and args.process_index == a.fail_save_rank:
            # e.g. a script's own cleanup: the process (and its connections) stay alive
            print(f"LINGERING after {type(exc).__name__}: {exc}", flush=True)
            time.sleep(a.linger)
        raise
    if a.final_dir and trainer.args.process_index == 0:
        trainer.save_model(a.final_dir)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
