"""Run the same script under transformers' Trainer and ours: only the Trainer / TrainingArguments
classes differ. Used by the evaluation, data and activation-checkpointing tests."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

IMPLEMENTATIONS = ("transformers", "ours")


def classes(which: str) -> tuple[type, type]:
    """``(Trainer, TrainingArguments)`` of ``which`` (``"transformers"`` or ``"ours"``)."""
    if which == "transformers":
        import transformers

        return transformers.Trainer, transformers.TrainingArguments
    from trainer_runtime.trainer import Trainer
    from trainer_runtime.training_args import TrainingArguments

    return Trainer, TrainingArguments


def make_trainer(
    which: str, out: Path, *, args: dict[str, Any] | None = None, **kwargs: Any
) -> Any:
    """A Trainer of ``which`` with the tier's common arguments (CPU, no saving, no reporting,
    logging every step) plus ``args``; ``kwargs`` go to the Trainer (model, datasets, ...)."""
    trainer_cls, args_cls = classes(which)
    options: dict[str, Any] = {
        "output_dir": str(out / which),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_steps": 3,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "seed": 0,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        **(args or {}),
    }
    with warnings.catch_warnings():
        # gradient_checkpointing is a deprecated alias in both implementations.
        warnings.simplefilter("ignore", FutureWarning)
        return trainer_cls(args=args_cls(**options), **kwargs)


def train_losses(trainer: Any) -> list[float]:
    """The per-step training losses of a finished ``train()`` (from ``log_history``)."""
    trainer.train()
    losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    assert losses, "no training loss was logged"
    return losses


def both(run: Callable[[str], Any]) -> dict[str, Any]:
    """``run(which)`` for both implementations (transformers first)."""
    return {which: run(which) for which in IMPLEMENTATIONS}


def assert_nested_close(ours: Any, reference: Any, *, atol: float = 1e-5) -> None:
    """Same nesting (tuples/lists), same shapes, values equal within ``atol``."""
    if isinstance(reference, (tuple, list)):
        assert isinstance(ours, (tuple, list)), f"expected a {type(reference).__name__}"
        assert len(ours) == len(reference)
        for a, b in zip(ours, reference, strict=True):
            assert_nested_close(a, b, atol=atol)
        return
    assert isinstance(ours, np.ndarray), f"expected a numpy array, got {type(ours).__name__}"
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=atol, rtol=1e-5)
