"""Summarization / translation, shaped like transformers' task guides and
``run_summarization.py`` / ``run_translation.py``: a ``source_prefix``, inputs and
``text_target`` tokenized separately, ``DataCollatorForSeq2Seq(model=model)`` (padded labels at
-100, ``decoder_input_ids`` from the model), tiny T5.

:func:`main` trains with the plain ``Trainer`` (teacher-forced loss and logits);
:func:`main_generate` is the guides' ``Seq2SeqTrainer`` with ``predict_with_generate``."""

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

SOURCE_PREFIX = "the "  # T5's "summarize: " / "translate X to Y: ", in the tiny vocabulary


def reverse_dataset(n: int, seed: int) -> Any:
    """Source sentence -> its words reversed (the "translation")."""
    import datasets

    texts = models.corpus(n, seed)
    return datasets.Dataset.from_dict(
        {"document": texts, "summary": [" ".join(reversed(t.split())) for t in texts]}
    )


def _run(argv: list[str], api: Api, *, generate: bool) -> dict[str, Any]:
    from transformers import DataCollatorForSeq2Seq

    if generate and api.Seq2SeqTrainer is None:
        raise NotImplementedError(f"{api.name} has no Seq2SeqTrainer")
    args_cls = api.Seq2SeqTrainingArguments if generate else api.TrainingArguments
    model_args, data_args, training_args = parse(argv, api, args_cls)
    last_checkpoint = detect_last_checkpoint(training_args, api)
    api.set_seed(training_args.seed)

    tokenizer = models.tokenizer()
    model = models.t5(tokenizer, seed=model_args.model_seed)
    raw_train = reverse_dataset(data_args.num_train_examples, 1)
    raw_eval = reverse_dataset(data_args.num_eval_examples, 2)

    def preprocess_function(examples: dict[str, Any]) -> Any:
        inputs = [SOURCE_PREFIX + doc for doc in examples["document"]]
        model_inputs = tokenizer(inputs, max_length=data_args.max_seq_length, truncation=True)
        labels = tokenizer(
            text_target=examples["summary"], max_length=data_args.max_target_length, truncation=True
        )
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    columns = raw_train.column_names
    train_dataset = raw_train.map(preprocess_function, batched=True, remove_columns=columns)
    eval_dataset = raw_eval.map(preprocess_function, batched=True, remove_columns=columns)
    data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def compute_metrics(eval_preds: Any) -> dict[str, float]:
        preds, labels = eval_preds
        if isinstance(preds, tuple):
            preds = preds[0]
        if not generate:
            preds = np.argmax(preds, axis=-1)
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_preds = tokenizer.batch_decode(preds, skip_special_tokens=True)
        decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
        exact = [p.strip() == r.strip() for p, r in zip(decoded_preds, decoded_labels, strict=True)]
        lengths = [np.count_nonzero(p != tokenizer.pad_token_id) for p in preds]
        return {"exact_match": float(np.mean(exact)), "gen_len": float(np.mean(lengths))}

    trainer_cls = api.Seq2SeqTrainer if generate else api.Trainer
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        results["train"] = train_and_save(
            trainer, training_args, last_checkpoint, len(train_dataset)
        )
    gen_kwargs = {"max_length": data_args.max_target_length} if generate else {}
    if training_args.do_eval:
        results["eval"] = evaluate(trainer, len(eval_dataset), **gen_kwargs)
    if training_args.do_predict:
        results["predict"] = predict(trainer, eval_dataset, **gen_kwargs)
    return results


def main(argv: list[str], api: Api) -> dict[str, Any]:
    return _run(argv, api, generate=False)


def main_generate(argv: list[str], api: Api) -> dict[str, Any]:
    return _run(argv, api, generate=True)
