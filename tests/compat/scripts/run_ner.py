"""Token classification, shaped like transformers' token classification task guide /
``run_ner.py``: words tokenized with ``is_split_into_words``, labels aligned to tokens with
``word_ids()`` (-100 on special tokens and on every sub-token but the first),
``DataCollatorForTokenClassification``, token accuracy in ``compute_metrics``."""

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

LABEL_LIST = ["O", "COLOR", "ANIMAL"]
_TAGS = {"red": 1, "green": 1, "blue": 1, "cat": 2, "dog": 2, "bird": 2}


def ner_dataset(n: int, seed: int) -> Any:
    import datasets

    tokens = [s.split() for s in models.corpus(n, seed)]
    return datasets.Dataset.from_dict(
        {"tokens": tokens, "ner_tags": [[_TAGS.get(w, 0) for w in ws] for ws in tokens]}
    )


def compute_metrics(p: Any) -> dict[str, float]:
    predictions = np.argmax(p.predictions, axis=2)
    keep = p.label_ids != -100
    return {"accuracy": float((predictions[keep] == p.label_ids[keep]).mean())}


def main(argv: list[str], api: Api) -> dict[str, Any]:
    from transformers import DataCollatorForTokenClassification

    model_args, data_args, training_args = parse(argv, api)
    last_checkpoint = detect_last_checkpoint(training_args, api)
    api.set_seed(training_args.seed)

    tokenizer = models.tokenizer()
    model = models.bert_token_classifier(tokenizer, len(LABEL_LIST), seed=model_args.model_seed)
    raw_train = ner_dataset(data_args.num_train_examples, 1)
    raw_eval = ner_dataset(data_args.num_eval_examples, 2)

    def tokenize_and_align_labels(examples: dict[str, Any]) -> Any:
        tokenized = tokenizer(
            examples["tokens"],
            truncation=True,
            max_length=data_args.max_seq_length,
            is_split_into_words=True,
        )
        labels = []
        for i, label in enumerate(examples["ner_tags"]):
            previous, label_ids = None, []
            for word_idx in tokenized.word_ids(batch_index=i):
                if word_idx is None or word_idx == previous:
                    label_ids.append(-100)
                else:
                    label_ids.append(label[word_idx])
                previous = word_idx
            labels.append(label_ids)
        tokenized["labels"] = labels
        return tokenized

    columns = raw_train.column_names
    train_dataset = raw_train.map(tokenize_and_align_labels, batched=True, remove_columns=columns)
    eval_dataset = raw_eval.map(tokenize_and_align_labels, batched=True, remove_columns=columns)
    data_collator = DataCollatorForTokenClassification(tokenizer)

    trainer = api.Trainer(
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
    if training_args.do_eval:
        results["eval"] = evaluate(trainer, len(eval_dataset))
    if training_args.do_predict:
        results["predict"] = predict(trainer, eval_dataset)
    return results
