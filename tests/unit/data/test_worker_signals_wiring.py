"""Which DataLoaders get the SIGTERM shield (trainer_runtime/data/worker_signals.py): our
Trainer's train, eval and predict loaders (overridden ones too), anything through its
``accelerator.prepare``, and a ``transformers.Trainer``'s own loaders under ``install()`` or
``attach()``; the user's (or transformers') ``worker_init_fn`` is kept behind it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from trainer_runtime.data.arguments import seed_worker
from trainer_runtime.data.worker_signals import is_shielded
from trainer_runtime.toy import ToyDataset, build_trainer, parse_args


def _user_init(worker_id: int) -> None:
    pass


def _toy(tmp_path: Path) -> Any:
    out = str(tmp_path / "out")
    args = parse_args(["--output-dir", out, "--max-steps", "1", "--dataloader-num-workers", "2"])
    return build_trainer(args)


def _seen_by_evaluation_loop(trainer: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    original = trainer.evaluation_loop

    def spy(loader: Any, *a: Any, **kw: Any) -> Any:
        seen.append(loader)
        return original(loader, *a, **kw)

    monkeypatch.setattr(trainer, "evaluation_loop", spy)
    return seen


def test_our_trainers_loaders_are_shielded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _toy(tmp_path)
    train = trainer.get_train_dataloader()
    assert is_shielded(train.worker_init_fn) and train.worker_init_fn.user_fn is seed_worker
    seen = _seen_by_evaluation_loop(trainer, monkeypatch)
    trainer.evaluate(ToyDataset(16, seed=1))
    trainer.predict(ToyDataset(16, seed=2))
    assert len(seen) == 2 and all(is_shielded(loader.worker_init_fn) for loader in seen)


def test_overridden_loaders_and_accelerator_prepare_are_shielded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = _toy(tmp_path)
    own = DataLoader(ToyDataset(16, seed=1), batch_size=4, num_workers=2, worker_init_fn=_user_init)
    monkeypatch.setattr(trainer, "get_eval_dataloader", lambda *_a, **_k: own)
    seen = _seen_by_evaluation_loop(trainer, monkeypatch)
    trainer.evaluate()
    assert seen == [own] and is_shielded(own.worker_init_fn)
    assert own.worker_init_fn.user_fn is _user_init  # kept
    mine = DataLoader(ToyDataset(16, seed=1), batch_size=4, num_workers=2)
    prepared = trainer.accelerator.prepare(mine)
    assert is_shielded(prepared.worker_init_fn)


def _hf_trainer(tmp_path: Path) -> Any:
    from transformers import Trainer, TrainingArguments

    from trainer_runtime.toy import ToyModel

    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        report_to="none",
        use_cpu=True,
        max_steps=1,
        dataloader_num_workers=2,
        per_device_train_batch_size=4,
    )
    data = ToyDataset(16, seed=1)
    return Trainer(model=ToyModel(), args=args, train_dataset=data, eval_dataset=data)


@pytest.mark.parametrize("way", ["install", "attach"])
def test_transformers_trainers_loaders_are_shielded(tmp_path: Path, way: str) -> None:
    pytest.importorskip("transformers", reason="the integration needs transformers (dev extra)")
    from trainer_runtime.hf import attach, install, uninstall

    if way == "install":
        install()
        try:
            trainer = _hf_trainer(tmp_path)
        finally:
            uninstall()
    else:
        trainer = _hf_trainer(tmp_path)
        attach(trainer)
    train = trainer.get_train_dataloader()
    assert is_shielded(train.worker_init_fn), train.worker_init_fn
    assert train.worker_init_fn.user_fn is not None  # transformers' seed_worker, kept
    assert is_shielded(trainer.get_eval_dataloader().worker_init_fn)


def test_without_the_integration_transformers_loaders_are_not_shielded(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the integration needs transformers (dev extra)")
    trainer = _hf_trainer(tmp_path)
    assert not is_shielded(trainer.get_train_dataloader().worker_init_fn)
