"""Shared by the checkpoint tests of the real-model tier: one training script, run under
transformers' Trainer or ours (only the imports differ), and small file helpers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.transformers import models

OURS, THEIRS = "ours", "transformers"


def trainer_classes(side: str) -> tuple[Any, Any]:
    if side == THEIRS:
        from transformers import Trainer, TrainingArguments
    else:
        from trainer_runtime import Trainer, TrainingArguments
    return Trainer, TrainingArguments


def causal_data(tok: Any, n: int = 16) -> Any:
    return models.causal_lm_dataset(tok, n=n).remove_columns(["text"])


def classification_data(tok: Any, n: int = 16) -> Any:
    return models.classification_dataset(tok, n=n).remove_columns(["text"])


def collator_for(kind: str, tok: Any) -> Any:
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding

    if kind == "bert_classifier":
        return DataCollatorWithPadding(tok)
    return DataCollatorForLanguageModeling(tok, mlm=False)


def build_model(kind: str, tok: Any) -> Any:
    return getattr(models, kind)(tok)


def make_trainer(
    side: str,
    model: Any,
    out: Path,
    tok: Any,
    dataset: Any,
    collator: Any,
    **overrides: Any,
) -> Any:
    """The same script for both Trainers: sequential data (the two samplers' random orders
    differ), no dropout, seed 0, a loss logged every step."""
    trainer_cls, args_cls = trainer_classes(side)
    kwargs: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "warmup_steps": 2,
        "max_steps": 6,
        "save_steps": 3,
        "logging_steps": 1,
        "seed": 0,
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "train_sampling_strategy": "sequential",
    }
    kwargs.update(overrides)
    return trainer_cls(
        model=model,
        args=args_cls(**kwargs),
        train_dataset=dataset,
        data_collator=collator,
        processing_class=tok,
    )


def losses(trainer: Any, since: int = 0) -> dict[int, float]:
    """step -> training loss logged at that step, for the steps after ``since`` (a resumed run's
    history starts with the checkpoint's)."""
    history = trainer.state.log_history
    return {h["step"]: h["loss"] for h in history if "loss" in h and h["step"] > since}


def listed_files(checkpoint: Path) -> set[str]:
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    return {entry["path"] for entry in manifest["files"]}


def safetensors_names(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return set(fh.keys())


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name].cpu(), b[name].cpu()), name
