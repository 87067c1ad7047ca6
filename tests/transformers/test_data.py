"""Data handling with real models, side by side with transformers' Trainer: signature-based
column removal (a ``**kwargs`` forward does not accept a raw ``text`` column; PEFT models are
inspected through their base model) and the default collator built from ``processing_class``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.transformers import models
from tests.transformers.side_by_side import both, make_trainer, train_losses


def test_bert_classification_with_its_text_column_trains_like_transformers(
    tok: Any, tmp_path: Path
) -> None:
    from transformers import DataCollatorWithPadding

    def run(which: str) -> list[float]:
        dataset = models.classification_dataset(tok)
        assert "text" in dataset.column_names
        trainer = make_trainer(
            which,
            tmp_path,
            model=models.bert_classifier(tok),
            data_collator=DataCollatorWithPadding(tok),
            train_dataset=dataset,
        )
        return train_losses(trainer)

    runs = both(run)
    assert runs["ours"] == pytest.approx(runs["transformers"], rel=1e-6)


def test_a_plain_list_dataset_loses_its_text_field_before_collation(
    tok: Any, tmp_path: Path
) -> None:
    """Not a datasets.Dataset: the fields forward() does not name are dropped per example."""
    from transformers import DataCollatorWithPadding

    examples = list(models.classification_dataset(tok))
    assert "text" in examples[0]

    def run(which: str) -> list[float]:
        trainer = make_trainer(
            which,
            tmp_path,
            model=models.bert_classifier(tok),
            data_collator=DataCollatorWithPadding(tok),
            train_dataset=examples,
        )
        return train_losses(trainer)

    runs = both(run)
    assert runs["ours"] == pytest.approx(runs["transformers"], rel=1e-6)


def test_processing_class_tokenizer_without_collator_pads_like_transformers(
    tok: Any, tmp_path: Path
) -> None:
    def run(which: str) -> tuple[list[float], float]:
        dataset = models.classification_dataset(tok)
        trainer = make_trainer(
            which,
            tmp_path,
            model=models.bert_classifier(tok),
            processing_class=tok,
            train_dataset=dataset,
            eval_dataset=dataset,
        )
        losses = train_losses(trainer)
        return losses, trainer.evaluate()["eval_loss"]

    runs = both(run)
    assert runs["ours"][0] == pytest.approx(runs["transformers"][0], rel=1e-6)
    assert runs["ours"][1] == pytest.approx(runs["transformers"][1], rel=1e-6)


def test_peft_model_columns_follow_the_base_model_forward(tok: Any, tmp_path: Path) -> None:
    """A LoRA-wrapped GPT-2 (forward(*args, **kwargs)) on a set that keeps ``text``."""
    peft = pytest.importorskip("peft")
    from transformers import DataCollatorForLanguageModeling

    def run(which: str) -> list[float]:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
        model = peft.get_peft_model(models.gpt2(tok), config)
        trainer = make_trainer(
            which,
            tmp_path,
            model=model,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            train_dataset=models.causal_lm_dataset(tok),
        )
        return train_losses(trainer)

    runs = both(run)
    assert runs["ours"] == pytest.approx(runs["transformers"], rel=1e-6)
