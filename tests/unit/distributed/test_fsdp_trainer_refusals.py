"""The Trainer refuses FSDP it cannot run before touching the model (single process, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.toy import ToyDataset, ToyModel
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"fsdp": "full_shard"}, "fsdp='full_shard' with 1 process: sharding needs at least 2"),
        ({"fsdp": "shard_grad_op auto_wrap"}, "leave fsdp unset"),
    ],
)
def test_single_process_fsdp_is_refused(tmp_path: Path, kw: dict[str, Any], needle: str) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)
    model = ToyModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigurationError, match=needle):
        Trainer(model=model, args=args, train_dataset=ToyDataset(16))
    # Nothing was sharded: the model is still a plain module with its weights.
    assert type(model) is ToyModel
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_fsdp_the_trainer_reports_it_off(tmp_path: Path) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = Trainer(model=ToyModel(), args=args, train_dataset=ToyDataset(16))
    assert trainer.is_fsdp_enabled is False
