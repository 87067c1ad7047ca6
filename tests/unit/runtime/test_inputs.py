"""Batches reach the model as keyword arguments; unused keys are dropped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

from .tiny import ClassificationData, TinyClassifier


class WithExtras(ClassificationData):
    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**super().__getitem__(i), "idx": i, "text": f"example {i}"}


def args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, save_strategy="no", use_cpu=True, **kw
    )


def test_unused_columns_are_removed(tmp_path: Path) -> None:
    trainer = Trainer(model=TinyClassifier(), args=args(tmp_path), train_dataset=WithExtras(16))
    assert trainer.train().global_step == 2


def test_keeping_unused_columns_reaches_the_model(tmp_path: Path) -> None:
    trainer = Trainer(
        model=TinyClassifier(),
        args=args(tmp_path, remove_unused_columns=False),
        train_dataset=WithExtras(16),
    )
    with pytest.raises(TypeError, match="idx"):
        trainer.train()


def test_tuple_outputs_and_missing_loss(tmp_path: Path) -> None:
    class NoLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.fc(x)}

    trainer = Trainer(model=NoLoss(), args=args(tmp_path), train_dataset=ClassificationData(16))
    with pytest.raises(ValueError, match="did not return a loss"):
        trainer.train()


def test_iterable_dataset_needs_max_steps(tmp_path: Path) -> None:
    from .tiny import IterableClassificationData

    trainer = Trainer(
        model=TinyClassifier(),
        args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
        train_dataset=IterableClassificationData(8),
    )
    with pytest.raises(ConfigurationError, match="set max_steps to a positive"):
        trainer.train()


def test_model_is_required() -> None:
    with pytest.raises(ConfigurationError, match="requires a model"):
        Trainer(args=TrainingArguments(output_dir="out"))
