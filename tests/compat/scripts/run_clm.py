"""Causal language modelling, shaped like transformers' ``examples/pytorch/language-modeling/
run_clm.py``: tokenize, ``group_texts`` into blocks, default collator, perplexity."""

from __future__ import annotations

import math
from itertools import chain
from typing import Any

from tests.compat.scripts.common import (
    Api,
    detect_last_checkpoint,
    evaluate,
    parse,
    predict,
    train_and_save,
)
from tests.transformers import models


def main(argv: list[str], api: Api) -> dict[str, Any]:
    import datasets
    from transformers import default_data_collator

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
    builder = models.llama if model_args.model_name_or_path == "llama" else models.gpt2
    model = builder(tokenizer, seed=model_args.model_seed)

    def tokenize_function(examples: dict[str, list[str]]) -> Any:
        return tokenizer(examples["text"])

    tokenized = raw.map(tokenize_function, batched=True, remove_columns=["text"])
    block_size = data_args.block_size

    def group_texts(examples: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
        # Concatenate everything, drop the remainder, split into blocks; labels are the inputs.
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = (len(concatenated["input_ids"]) // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized.map(group_texts, batched=True)
    train_dataset, eval_dataset = lm_datasets["train"], lm_datasets["validation"]

    trainer = api.Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
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
    if training_args.do_predict:
        results["predict"] = predict(trainer, eval_dataset)
    trainer.create_model_card(model_name=model_args.model_name_or_path, tasks="text-generation")
    return results
