"""The data pipeline inside the real Trainer: length samplers, padding and NEFTune resume exactly.

Until the Trainer builds these from TrainingArguments itself, a Trainer subclass overrides
get_train_dataloader (the documented extension point) to use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainer_runtime.data.collators import PaddingCollator
from trainer_runtime.data.length_sampling import build_length_batch_sampler
from trainer_runtime.data.neftune import enable_neftune
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

from ..builders import StopAt


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)


class Sequences(Dataset):
    """Token sequences of skewed lengths (next-token targets)."""

    def __init__(self, n: int = 48, vocab: int = 20, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        lengths = (torch.rand(n, generator=g) ** 3 * 30).long() + 2
        self.items = [torch.randint(1, vocab, (int(k),), generator=g) for k in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.items[i]
        return {"input_ids": ids, "labels": ids.clone(), "length": len(ids)}


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, Any]:
        logits = self.head(self.embed(input_ids) * attention_mask.unsqueeze(-1))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


class LengthTrainer(Trainer):
    """What the Trainer's own get_train_dataloader does once the strategies are wired."""

    strategy = "group_by_length"

    def get_train_dataloader(self) -> DataLoader:
        args = self.args
        self.train_sampler = build_length_batch_sampler(
            self.strategy,
            self.train_dataset,
            args.per_device_train_batch_size,
            seed=args.seed,
            drop_last=args.dataloader_drop_last,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
        )
        generator = torch.Generator()
        generator.manual_seed(args.seed)
        return DataLoader(
            self.train_dataset,
            batch_sampler=self.train_sampler,
            collate_fn=self.data_collator,
            generator=generator,
        )


def make(out: Path, strategy: str, callbacks: list[Any] | None = None) -> LengthTrainer:
    torch.manual_seed(3)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=5e-2,
        save_steps=100,
        logging_steps=1,
        use_cpu=True,
        remove_unused_columns=True,
    )
    trainer = LengthTrainer(
        model=TinyLM(),
        args=args,
        data_collator=PaddingCollator(),
        train_dataset=Sequences(),
        callbacks=callbacks,
    )
    trainer.strategy = strategy
    return trainer


@pytest.mark.parametrize("strategy", ["group_by_length", "batch_rebalance"])
@pytest.mark.parametrize("stop", [2, 9])  # mid-epoch 0; in epoch 1
def test_resume_is_bit_identical_with_neftune(tmp_path: Path, strategy: str, stop: int) -> None:
    full = make(tmp_path / "full", strategy)
    with enable_neftune(full.model, 5.0):
        full.train()

    first = make(tmp_path / "cut", strategy, callbacks=[StopAt(stop)])
    with enable_neftune(first.model, 5.0):
        first.train()
    assert first.state.global_step == stop
    second = make(tmp_path / "cut", strategy)
    with enable_neftune(second.model, 5.0):
        second.train(resume_from_checkpoint=True)

    assert second.state.global_step == full.state.global_step
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, second.model.state_dict()[name]), f"{name} differs"
    assert len(full.model.embed._forward_hooks) == 0  # NEFTune left nothing behind


def test_neftune_changes_training(tmp_path: Path) -> None:
    plain = make(tmp_path / "plain", "group_by_length")
    plain.train()
    noisy = make(tmp_path / "noisy", "group_by_length")
    with enable_neftune(noisy.model, 5.0):
        noisy.train()
    assert not torch.equal(plain.model.embed.weight, noisy.model.embed.weight)
