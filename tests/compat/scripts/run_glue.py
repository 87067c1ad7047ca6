"""Sequence classification, shaped like transformers' ``examples/pytorch/text-classification/
run_glue.py``: tokenize with padding/truncation, ``DataCollatorWithPadding``, accuracy in
``compute_metrics``, evaluate and predict (argmax of the logits)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.compat.scripts.common import (
    Api,
    detect_last_checkpoint,
    evaluate,
    parse,
    predict,
    train_and_save,
)
from tests.transformers import models


def compute_metrics(p: Any) -> dict[str, float]:
    preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
    preds = np.argmax(preds, axis=1)
    return {"accuracy": float((preds == p.label_ids).astype(np.float32).mean())}


def main(argv: list[str], api: Api) -> dict[str, Any]:
    from transformers import DataCollatorWithPadding, default_data_collator

    model_args, data_args, training_args = parse(argv, api)
    last_checkpoint = detect_last_checkpoint(training_args, api)
    api.set_seed(training_args.seed)

    tokenizer = models.tokenizer()
    raw_train = models.classification_dataset(tokenizer, data_args.num_train_examples, 1)
    raw_eval = models.classification_dataset(tokenizer, data_args.num_eval_examples, 2)
    raw_train = raw_train.select_columns(["text", "label"])
    raw_eval = raw_eval.select_columns(["text", "label"])
    model = models.bert_classifier(tokenizer, num_labels=2, seed=model_args.model_seed)
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess_function(examples: dict[str, Any]) -> Any:
        return tokenizer(
            examples["text"], padding=padding, max_length=data_args.max_seq_length, truncation=True
        )

    train_dataset = raw_train.map(preprocess_function, batched=True)
    eval_dataset = raw_eval.map(preprocess_function, batched=True)
    predict_dataset = eval_dataset.remove_columns("label")
    if data_args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        data_collator = DataCollatorWithPadding(tokenizer)

    trainer = api.Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=data_collator,
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        results["train"] = train_and_save(
            trainer, training_args, last_checkpoint, len(train_dataset)
        )
    if training_args.do_eval:
        results["eval"] = evaluate(trainer, len(eval_dataset))
    if training_args.do_predict:
        output = predict(trainer, predict_dataset)
        results["predict"] = output
        results["predicted_labels"] = np.argmax(output.predictions, axis=1)
    trainer.create_model_card(model_name=model_args.model_name_or_path, tasks="text-classification")
    return results
