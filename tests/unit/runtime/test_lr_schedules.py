from __future__ import annotations

import math

import pytest
import torch

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.optim import (
    create_optimizer,
    create_scheduler,
    lr_lambda,
    resolve_warmup_steps,
)
from trainer_runtime.training_args import TrainingArguments

from .tiny import TinyClassifier

W, T = 2, 10  # warmup steps, total steps


@pytest.mark.parametrize(
    ("name", "step", "expected"),
    [
        ("constant", 0, 1.0),
        ("constant", 9, 1.0),
        ("constant_with_warmup", 0, 0.0),
        ("constant_with_warmup", 1, 0.5),
        ("constant_with_warmup", 2, 1.0),
        ("constant_with_warmup", 9, 1.0),
        ("linear", 0, 0.0),
        ("linear", 1, 0.5),
        ("linear", 2, 1.0),
        ("linear", 6, 0.5),
        ("linear", 10, 0.0),
        ("linear", 12, 0.0),
        ("cosine", 1, 0.5),
        ("cosine", 2, 1.0),
        ("cosine", 6, 0.5),
        ("cosine", 10, 0.0),
        ("cosine_with_restarts", 6, 0.5),
        ("cosine_with_restarts", 10, 0.0),
        ("polynomial", 2, 1.0),
        ("polynomial", 6, 0.5 + 0.5e-7 / 1.0),
    ],
)
def test_schedule_multipliers(name: str, step: int, expected: float) -> None:
    fn = lr_lambda(name, warmup=W, total=T, lr_init=1.0)
    assert fn(step) == pytest.approx(expected, abs=1e-9)


def test_cosine_with_restarts_cycles() -> None:
    fn = lr_lambda("cosine_with_restarts", warmup=0, total=8, lr_init=1.0, kwargs={"num_cycles": 2})
    # two cycles of 4 steps: back to the peak at step 4
    assert fn(0) == pytest.approx(1.0)
    assert fn(2) == pytest.approx(0.5)
    assert fn(4) == pytest.approx(1.0)


def test_unknown_schedule_kwargs_fail_clearly() -> None:
    with pytest.raises(ConfigurationError, match=r"lr_scheduler_kwargs.*\['power'\].*'cosine'"):
        lr_lambda("cosine", warmup=0, total=5, lr_init=1.0, kwargs={"power": 2})


@pytest.mark.parametrize(
    ("warmup", "total", "expected"), [(0, 10, 0), (3, 10, 3), (0.1, 10, 1), (0.25, 10, 3)]
)
def test_warmup_ratio(warmup: float, total: int, expected: int) -> None:
    assert resolve_warmup_steps(warmup, total) == expected


def test_scheduler_drives_optimizer_lr() -> None:
    args = TrainingArguments(output_dir="out", learning_rate=0.1, warmup_steps=2, optim="sgd")
    optimizer = create_optimizer(TinyClassifier(), args)
    scheduler = create_scheduler(optimizer, args, max_steps=10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen[:3] == pytest.approx([0.0, 0.05, 0.1])
    assert seen[6] == pytest.approx(0.05)
    assert all(math.isfinite(x) for x in seen)
    assert isinstance(optimizer, torch.optim.SGD)
