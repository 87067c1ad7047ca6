"""A real ``datasets.Dataset`` inside the Trainer: unused columns (strings included) are removed
before collation, the length column still drives the length samplers, evaluation works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainer_runtime.data.collators import PaddingCollator
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

from ..builders import StopAt


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 20, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, Any]:
        logits = self.head(self.embed(input_ids) * attention_mask.unsqueeze(-1))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def hf_dataset(n: int = 24) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 20, (int(k),), generator=g).tolist() for k in range(2, n + 2)]
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "labels": ids,
            # A raw-text column the collator could not batch: it must be gone before collation.
            "text": [" ".join(map(str, x)) for x in ids],
            "length": [len(x) for x in ids],
        }
    )


def make(out: Path, strategy: str, remove: bool = True) -> Trainer:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=3,
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=remove,
        train_sampling_strategy=strategy,
        length_column_name="length",
        report_to="none",
    )
    return Trainer(
        model=TinyLM(),
        args=args,
        data_collator=PaddingCollator(),
        train_dataset=hf_dataset(),
        eval_dataset=hf_dataset(),
    )


@pytest.mark.parametrize("strategy", ["random", "group_by_length", "batch_rebalance"])
def test_unused_columns_are_dropped_and_the_length_column_is_used(
    tmp_path: Path, strategy: str
) -> None:
    trainer = make(tmp_path, strategy)
    seen: list[set[str]] = []
    collate = trainer.data_collator
    trainer.data_collator = lambda features: (seen.append(set(features[0])), collate(features))[1]
    trainer.train()
    # Every batch reached the collator without the text column; the length column is kept for
    # the sampler and never reaches forward().
    assert seen and all("text" not in keys for keys in seen)
    assert trainer.state.global_step == 3
    n_train = len(seen)
    metrics = trainer.evaluate()
    assert len(seen) > n_train and all("text" not in keys for keys in seen[n_train:])
    assert metrics["eval_loss"] > 0


def test_without_removal_the_text_column_reaches_the_collator(tmp_path: Path) -> None:
    trainer = make(tmp_path, "random", remove=False)
    with pytest.raises(Exception, match="text"):
        trainer.train()


def test_iterable_hf_dataset_resumes_from_its_own_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = hf_dataset(16).remove_columns(["text", "length"]).to_list()

    def stream() -> datasets.IterableDataset:
        return datasets.IterableDataset.from_generator(lambda: iter(rows))

    def run(out: Path, stop: int | None = None, resume: str | None = None) -> Trainer:
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=2,
            max_steps=10,
            save_steps=3,
            use_cpu=True,
            disable_tqdm=True,
            report_to="none",
        )
        trainer = Trainer(
            model=TinyLM(), args=args, data_collator=PaddingCollator(), train_dataset=stream()
        )
        if stop is not None:
            trainer.add_callback(StopAt(stop))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    run(tmp_path / "run", stop=3)
    state = tmp_path / "run" / "checkpoint-3" / "dataset_state.json"
    assert state.is_file()
    with caplog.at_level("WARNING"):
        resumed = run(tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-3"))
    assert "skipping" not in caplog.text
    for name, value in full.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
