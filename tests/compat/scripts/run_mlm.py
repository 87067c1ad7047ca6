"""Masked language modelling, shaped like transformers' ``examples/pytorch/language-modeling/
run_mlm.py``: line-by-line tokenization, ``DataCollatorForLanguageModeling(mlm=True)``, tiny
BERT."""

from __future__ import annotations

import math
from typing import Any

from tests.compat.scripts.common import (
    Api,
    detect_last_checkpoint,
    evaluate,
    parse,
    train_and_save,
)
from tests.transformers import models


def main(argv: list[str], api: Api) -> dict[str, Any]:
    import datasets
    from transformers import DataCollatorForLanguageModeling

    model_args, data_args, training_args = parse(argv, api)
    last_checkpoint = detect_last_checkpoint(training_args, api)
    api.set_seed(training_args.seed)

    def text_split(n: int, seed: int) -> datasets.Dataset:
        return datasets.Dataset.from_dict({"text": models.corpus(n, seed)})

    raw = datasets.DatasetDict(
        train=text_split(data_args.num_train_examples, 1),
        validation=text_split(data_args.num_eval_examples, 2),
    )
    tokenizer = models.tokenizer()
    model = models.bert_masked_lm(tokenizer, seed=model_args.model_seed)
    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize_function(examples: dict[str, list[str]]) -> Any:
        return tokenizer(
            examples["text"],
            padding=padding,
            truncation=True,
            max_length=data_args.max_seq_length,
            return_special_tokens_mask=True,
        )

    tokenized = raw.map(tokenize_function, batched=True, remove_columns=["text"])
    train_dataset, eval_dataset = tokenized["train"], tokenized["validation"]
    # Without a seed the masks come from torch's global generator, which transformers' DataLoader
    # also draws from (ours does not: resume safety), so only a seeded collator masks alike.
    data_collator = DataCollatorForLanguageModeling(
        tokenizer=tokenizer, mlm=True, mlm_probability=0.15, seed=data_args.mlm_seed
    )
    trainer = api.Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        results["train"] = train_and_save(
            trainer, training_args, last_checkpoint, len(train_dataset)
        )
    if training_args.do_eval:
        metrics = evaluate(trainer, len(eval_dataset))
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
        results["eval"] = metrics
    trainer.create_model_card(model_name=model_args.model_name_or_path, tasks="fill-mask")
    return results
