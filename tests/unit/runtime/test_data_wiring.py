"""The Trainer builds the data pipeline from TrainingArguments (data_args, length samplers,
NEFTune) and resumes it bit-identically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.data.test_trainer_wiring import Sequences, TinyLM
from trainer_runtime.data.collators import PaddingCollator
from trainer_runtime.data.length_sampling import LengthGroupedBatchSampler
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

from .test_resume import StopAt, assert_same_training


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)


def make(out: Path, **overrides: Any) -> Trainer:
    torch.manual_seed(3)
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_train_epochs": 2,
        "learning_rate": 5e-2,
        "save_steps": 100,
        "logging_steps": 1,
        "use_cpu": True,
        "train_sampling_strategy": "group_by_length",
        "neftune_noise_alpha": 5.0,
    }
    kwargs.update(overrides)
    return Trainer(
        model=TinyLM(),
        args=TrainingArguments(**kwargs),
        data_collator=PaddingCollator(),
        train_dataset=Sequences(),
    )


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance"])
def test_length_strategy_and_neftune_resume_bit_identical(tmp_path: Path, strategy: str) -> None:
    full = make(tmp_path / "full", train_sampling_strategy=strategy)
    full.train()
    if strategy == "group_by_length":
        assert isinstance(full.train_sampler, LengthGroupedBatchSampler)
    # NEFTune is removed after training: the embedding output is noise-free again
    full.model.train()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(full.model.embed(ids), full.model.embed(ids))
    assert not full.model.embed._forward_hooks

    first = make(tmp_path / "cut", train_sampling_strategy=strategy)
    first.add_callback(StopAt(7))  # in epoch 1
    first.train()
    resumed = make(tmp_path / "cut", train_sampling_strategy=strategy)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)


def test_neftune_changes_training(tmp_path: Path) -> None:
    with_noise = make(tmp_path / "a", max_steps=2)
    with_noise.train()
    without = make(tmp_path / "b", max_steps=2, neftune_noise_alpha=None)
    without.train()
    assert not torch.equal(with_noise.model.head.weight, without.model.head.weight)
