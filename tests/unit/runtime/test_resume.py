"""Resume restores everything: a resumed run is bit-identical to an uninterrupted one (CPU)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.checkpoint.layout import SENTINEL_NAME
from trainer_runtime.errors import ResumeError
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

from ..builders import StopAt
from .tiny import (
    ClassificationData,
    IterableClassificationData,
    StatefulIterableClassificationData,
    TinyClassifier,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)


def make_trainer(out: Path, dataset: Any = None, **overrides: Any) -> Trainer:
    torch.manual_seed(1)  # model init
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "num_train_epochs": 3,
        "learning_rate": 1e-2,
        "weight_decay": 0.1,
        "warmup_steps": 0.2,
        "lr_scheduler_type": "cosine",
        "save_steps": 4,
        "logging_steps": 1,
        "use_cpu": True,
    }
    kwargs.update(overrides)
    data = dataset if dataset is not None else ClassificationData(n=36)
    return Trainer(model=TinyClassifier(), args=TrainingArguments(**kwargs), train_dataset=data)


def assert_same_training(a: Trainer, b: Trainer) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{name} differs"
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]  # type: ignore[union-attr]
    for pid in oa:
        for key, value in oa[pid].items():
            assert torch.equal(value, ob[pid][key]), f"optimizer state {pid}.{key} differs"
    assert a.lr_scheduler.get_last_lr() == b.lr_scheduler.get_last_lr()  # type: ignore[union-attr]
    assert a.state.global_step == b.state.global_step
    losses_a = [e["loss"] for e in a.state.log_history if "loss" in e]
    losses_b = [e["loss"] for e in b.state.log_history if "loss" in e]
    assert losses_a == losses_b


@pytest.mark.parametrize(
    ("stop", "overrides"),
    [
        (3, {}),  # mid-epoch (epoch 0, batch 6 of 9)
        (5, {}),  # the last step of epoch 0 (partial accumulation: 9 batches, GA 2)
        (7, {"train_sampling_strategy": "sequential", "gradient_accumulation_steps": 1}),
    ],
)
def test_resume_is_bit_identical(tmp_path: Path, stop: int, overrides: dict) -> None:
    full = make_trainer(tmp_path / "full", **overrides)
    full.train()
    assert full.state.global_step == 15 if not overrides else full.state.global_step > stop

    first = make_trainer(tmp_path / "run", **overrides)
    first.add_callback(StopAt(stop))
    first.train()
    assert first.state.global_step == stop
    resumed = make_trainer(tmp_path / "run", **overrides)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.last_checkpoint is not None
    assert_same_training(full, resumed)


def test_resume_iterable_dataset_skips_by_iteration(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    common = {"max_steps": 12, "save_steps": 100}
    full = make_trainer(tmp_path / "full", IterableClassificationData(n=20), **common)
    full.train()
    first = make_trainer(tmp_path / "run", IterableClassificationData(n=20), **common)
    # 5-batch epochs, GA 2: steps 1-3 use epoch 0 (the 3rd is partial), step 4 batches 0-1 of
    # epoch 1
    first.add_callback(StopAt(4))
    first.train()
    resumed = make_trainer(tmp_path / "run", IterableClassificationData(n=20), **common)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert "skipping 2 batches of the iterable dataset" in caplog.text
    assert "has no state_dict()" in caplog.text
    assert_same_training(full, resumed)


def test_resume_iterable_dataset_uses_its_own_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    common = {"max_steps": 12, "save_steps": 100}
    full = make_trainer(tmp_path / "full", StatefulIterableClassificationData(n=20), **common)
    full.train()
    first_data = StatefulIterableClassificationData(n=20)
    first = make_trainer(tmp_path / "run", first_data, **common)
    first.add_callback(StopAt(4))  # epoch 1, 2 batches (8 examples) in
    first.train()
    assert (tmp_path / "run" / "checkpoint-4" / "dataset_state.json").is_file()
    data = StatefulIterableClassificationData(n=20)
    resumed = make_trainer(tmp_path / "run", data, **common)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert "skipping" not in caplog.text
    # Nothing read twice: the two runs together read exactly what the uninterrupted one read.
    assert first_data.reads + data.reads == full.train_dataset.reads  # type: ignore[union-attr]
    assert_same_training(full, resumed)


def test_iterable_dataset_state_is_not_used_with_workers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # With workers the dataset is iterated in another process: its state here never moves, so
    # resume falls back to skipping, with the reason in the warning.
    common = {"max_steps": 6, "save_steps": 100, "dataloader_num_workers": 1}
    full = make_trainer(tmp_path / "full", StatefulIterableClassificationData(n=20), **common)
    full.train()
    first = make_trainer(tmp_path / "run", StatefulIterableClassificationData(n=20), **common)
    first.add_callback(StopAt(4))
    first.train()
    assert not (tmp_path / "run" / "checkpoint-4" / "dataset_state.json").exists()
    resumed = make_trainer(tmp_path / "run", StatefulIterableClassificationData(n=20), **common)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert "skipping 2 batches" in caplog.text and "dataloader_num_workers > 0" in caplog.text
    assert_same_training(full, resumed)


def test_latest_skips_incomplete_and_logs_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_trainer(tmp_path, max_steps=4, save_steps=2)
    first.train()
    broken = tmp_path / "checkpoint-9"
    broken.mkdir()
    (broken / SENTINEL_NAME).write_text("{}")
    resumed = make_trainer(tmp_path, max_steps=6, save_steps=2)
    with caplog.at_level(logging.INFO):
        resumed.train(resume_from_checkpoint=True)
    assert "skipping incomplete checkpoint" in caplog.text and "checkpoint-9" in caplog.text
    assert resumed.state.log_history[0]["step"] == 1  # history carried over from the checkpoint
    assert [e["step"] for e in resumed.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]


def test_resume_errors_name_path_and_reason(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, max_steps=2)
    with pytest.raises(ResumeError, match=r"no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    missing = tmp_path / "checkpoint-77"
    with pytest.raises(ResumeError, match=rf"{missing}.*does not exist"):
        trainer.train(resume_from_checkpoint=str(missing))
    incomplete = tmp_path / "checkpoint-5"
    incomplete.mkdir()
    (incomplete / SENTINEL_NAME).write_text("{}")
    with pytest.raises(ResumeError, match=rf"{incomplete}"):
        trainer.train(resume_from_checkpoint=str(incomplete))


def test_env_resume_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 'latest' with nothing saved yet (a first attempt) starts from scratch
    monkeypatch.setenv(ENV_RESUME_FROM, "latest")
    first = make_trainer(tmp_path, max_steps=4, save_steps=2)
    first.train()
    assert first.state.log_history[0]["step"] == 1
    second = make_trainer(tmp_path, max_steps=6, save_steps=2)
    second.train()
    assert [e["step"] for e in second.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    monkeypatch.setenv(ENV_RESUME_FROM, str(tmp_path / "checkpoint-2"))
    third = make_trainer(tmp_path, max_steps=6, save_steps=2)
    third.train()
    assert [e["step"] for e in third.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    # an explicit False wins over the environment
    fourth = make_trainer(tmp_path / "other", max_steps=1)
    fourth.train(resume_from_checkpoint=False)
    assert fourth.state.global_step == 1


def test_changed_data_layout_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    make_trainer(tmp_path, max_steps=2, save_steps=2).train()
    resumed = make_trainer(tmp_path, max_steps=3, per_device_train_batch_size=2)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    # A new batch size is re-sharded exactly (the same samples consumed): resharding.py.
    assert "1 rank(s) x 4 samples, this run has 1 x 2" in caplog.text
    assert "re-sharded from batch 4 to batch 8" in caplog.text


def test_rotation_keeps_newest(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, max_steps=8, save_steps=2, save_total_limit=2)
    trainer.train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-6", "checkpoint-8"]


def test_save_only_model_resumes_with_fresh_optimizer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_trainer(tmp_path, max_steps=4, save_steps=4, save_only_model=True)
    first.train()
    files = {p.name for p in (tmp_path / "checkpoint-4").iterdir()}
    assert "model.safetensors" in files and "optimizer.safetensors" not in files
    resumed = make_trainer(tmp_path, max_steps=6, save_steps=100)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=True)
    assert "no optimizer/scheduler state" in caplog.text
    assert resumed.state.global_step == 6


def test_checkpoint_layout_and_trainer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    monkeypatch.setenv(ENV_ATTEMPT, "3")
    trainer = make_trainer(tmp_path, max_steps=3, save_steps=3)
    trainer.train()
    ckpt = tmp_path / "checkpoint-3"
    assert {p.name for p in ckpt.iterdir()} == {
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "preemptible_state.json",
        "rng_state.safetensors",
        "scheduler.json",
        "trainer_state.json",
        "training_args.json",
    }
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and state["max_steps"] == 3
    # transformers' TrainerState(**json) must load it: no key of ours in it
    assert "preemptible" not in state
    record = json.loads((ckpt / "preemptible_state.json").read_text())
    assert record["attempt"] == 3
    assert record["step_seconds"]["count"] == 3 and record["step_seconds"]["max"] > 0
    assert record["data_position"] == {
        "kind": "map",
        "epoch": 0,
        "batch": 6,
        "started": True,  # the epoch's iterator began (its draw of the global RNG is taken)
        "strategy": "random",
        "batch_size": 4,
        "world_size": 1,
        "data_seed": 42,
    }
    assert record["sigterm_to_exit_seconds"] == []
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["attempt"] == 3 and manifest["step"] == 3


def test_save_model_writes_loadable_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    trainer = make_trainer(tmp_path / "out", max_steps=1, save_strategy="no")
    trainer.train()
    assert trainer.save_model(str(tmp_path / "final")) == str(tmp_path / "final")
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(saved[name], tensor)
    assert (tmp_path / "final" / "training_args.json").exists()


def test_tied_weights_round_trip(tmp_path: Path) -> None:
    from trainer_runtime.checkpoint.model_state import load_model_state, model_state_tensors

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    tensors, meta = model_state_tensors(model)
    assert list(tensors) == ["embed.weight"] and "head.weight" in meta["preemptible.aliases"]
    other = Tied()
    load_model_state(other, tensors, meta)
    assert torch.equal(other.head.weight, model.embed.weight)
    assert other.head.weight is other.embed.weight  # still tied


def test_epoch_strategy_saves_at_epoch_ends_and_resumes(tmp_path: Path) -> None:
    # 36 samples, batch 4, GA 2: 9 micro-batches = 5 steps per epoch
    full = make_trainer(tmp_path / "full", save_strategy="epoch")
    full.train()
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == [
        "checkpoint-10",
        "checkpoint-15",
        "checkpoint-5",
    ]
    resumed = make_trainer(tmp_path / "run", save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-10"))
    assert_same_training(full, resumed)


def test_resuming_the_final_checkpoint_trains_nothing(tmp_path: Path) -> None:
    done = make_trainer(tmp_path, max_steps=3, save_steps=100)
    done.train()
    again = make_trainer(tmp_path, max_steps=3, save_steps=100)
    out = again.train(resume_from_checkpoint=True)
    assert out.global_step == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]
    for name, tensor in done.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor)
