"""Extractive question answering, shaped like transformers' question answering task guide:
question/context pairs tokenized with ``truncation="only_second"`` and offsets, character
answers turned into ``start_positions`` / ``end_positions``, default collator, tiny BERT
``ForQuestionAnswering``. The data are synthetic: the question is one word, the answer its first
occurrence in the context."""

from __future__ import annotations

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


def squad_like(n: int, seed: int) -> Any:
    import datasets

    contexts = models.corpus(n, seed)
    questions, answers = [], []
    for i, context in enumerate(contexts):
        words = context.split()
        word = words[i % len(words)]
        start = context.index(word)  # first occurrence, as in SQuAD's answer_start
        questions.append(word)
        answers.append({"text": [word], "answer_start": [start]})
    return datasets.Dataset.from_dict(
        {"question": questions, "context": contexts, "answers": answers}
    )


def main(argv: list[str], api: Api) -> dict[str, Any]:
    from transformers import DefaultDataCollator

    model_args, data_args, training_args = parse(argv, api)
    last_checkpoint = detect_last_checkpoint(training_args, api)
    api.set_seed(training_args.seed)

    tokenizer = models.tokenizer()
    model = models.bert_question_answering(tokenizer, seed=model_args.model_seed)
    raw_train = squad_like(data_args.num_train_examples, 1)
    raw_eval = squad_like(data_args.num_eval_examples, 2)

    def preprocess_function(examples: dict[str, Any]) -> Any:
        inputs = tokenizer(
            [q.strip() for q in examples["question"]],
            examples["context"],
            max_length=data_args.max_seq_length,
            truncation="only_second",
            return_offsets_mapping=True,
            padding="max_length",
        )
        offset_mapping = inputs.pop("offset_mapping")
        start_positions, end_positions = [], []
        for i, offset in enumerate(offset_mapping):
            answer = examples["answers"][i]
            start_char = answer["answer_start"][0]
            end_char = start_char + len(answer["text"][0])
            sequence_ids = inputs.sequence_ids(i)
            context_start = sequence_ids.index(1)
            context_end = len(sequence_ids) - 1 - sequence_ids[::-1].index(1)
            if offset[context_start][0] > start_char or offset[context_end][1] < end_char:
                start_positions.append(0)  # the answer was truncated away
                end_positions.append(0)
                continue
            idx = context_start
            while idx <= context_end and offset[idx][0] <= start_char:
                idx += 1
            start_positions.append(idx - 1)
            idx = context_end
            while idx >= context_start and offset[idx][1] >= end_char:
                idx -= 1
            end_positions.append(idx + 1)
        inputs["start_positions"] = start_positions
        inputs["end_positions"] = end_positions
        return inputs

    columns = raw_train.column_names
    train_dataset = raw_train.map(preprocess_function, batched=True, remove_columns=columns)
    eval_dataset = raw_eval.map(preprocess_function, batched=True, remove_columns=columns)

    trainer = api.Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=DefaultDataCollator(),
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
