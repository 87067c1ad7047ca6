"""Custom callbacks, shaped like the callbacks guide: a callback counting ``on_step_end`` /
``on_evaluate`` / ``on_log`` events (and what they saw), and one that stops training early by
setting ``control.should_training_stop``. Classification data and model as in ``run_glue``."""

from __future__ import annotations

from typing import Any

from tests.compat.scripts.common import Api, detect_last_checkpoint, parse
from tests.compat.scripts.run_glue import compute_metrics
from tests.transformers import models


def callback_classes(api: Api) -> tuple[type, type]:
    class CountingCallback(api.TrainerCallback):  # type: ignore[name-defined, misc]
        def __init__(self) -> None:
            self.counts = {"on_step_end": 0, "on_evaluate": 0, "on_log": 0}
            self.steps_seen: list[int] = []
            self.eval_metrics: list[dict[str, Any]] = []
            self.log_keys: list[list[str]] = []

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.counts["on_step_end"] += 1
            self.steps_seen.append(state.global_step)

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # type: ignore[no-untyped-def]
            self.counts["on_evaluate"] += 1
            self.eval_metrics.append(dict(metrics or {}))

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            self.counts["on_log"] += 1
            self.log_keys.append(sorted(logs or {}))

    class StopAtStepCallback(api.TrainerCallback):  # type: ignore[name-defined, misc]
        def __init__(self, stop_step: int) -> None:
            self.stop_step = stop_step

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step >= self.stop_step:
                control.should_training_stop = True
            return control

    return CountingCallback, StopAtStepCallback


def main(argv: list[str], api: Api, stop_step: int = 5) -> dict[str, Any]:
    from transformers import DataCollatorWithPadding

    model_args, data_args, training_args = parse(argv, api)
    last_checkpoint = detect_last_checkpoint(training_args, api)
    api.set_seed(training_args.seed)
    tokenizer = models.tokenizer()
    model = models.bert_classifier(tokenizer, num_labels=2, seed=model_args.model_seed)
    train_dataset = models.classification_dataset(tokenizer, data_args.num_train_examples, 1)
    eval_dataset = models.classification_dataset(tokenizer, data_args.num_eval_examples, 2)
    counting_cls, stop_cls = callback_classes(api)
    counting = counting_cls()
    trainer = api.Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=compute_metrics,
        callbacks=[counting, stop_cls(stop_step)],
    )
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint or last_checkpoint)
    return {
        "trainer": trainer,
        "counts": dict(counting.counts),
        "steps_seen": list(counting.steps_seen),
        "eval_metrics": list(counting.eval_metrics),
        "log_keys": list(counting.log_keys),
        "global_step": trainer.state.global_step,
    }
