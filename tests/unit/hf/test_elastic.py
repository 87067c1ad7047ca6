"""An elastic attempt of a stock transformers.Trainer (trainer_runtime/hf/elastic.py): the
accumulation set from the job's environment, and the shapes refused before training."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.hf.elastic import apply_elastic, epoch_keeps_steps


def _trainer(accumulation: int = 3, samples: Any = 48, **args: Any) -> SimpleNamespace:
    fields = {
        "gradient_accumulation_steps": accumulation,
        "train_sampling_strategy": "random",
        "deepspeed": None,
        "train_batch_size": 2,
        "dataloader_drop_last": False,
        "max_steps": 8,
        **args,
    }
    dataset = list(range(samples)) if isinstance(samples, int) else samples
    return SimpleNamespace(args=SimpleNamespace(**fields), train_dataset=dataset)


def _env(world: int, reference: int = 2, accumulation: int = 3, local: int = 1) -> dict[str, str]:
    return {
        "PREEMPTIBLE_ELASTIC_REFERENCE_NODES": str(reference),
        "PREEMPTIBLE_ELASTIC_ACCUMULATION": str(accumulation),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local),
    }


@pytest.mark.parametrize(
    ("samples", "batch", "per_step", "drop_last", "keeps"),
    [
        (48, 2, 6, False, True),  # 24 micro-batches, 4 steps
        (47, 2, 6, False, True),  # 24 micro-batches, the last one of a single row
        (46, 2, 6, False, False),  # 23
        (47, 2, 6, True, False),  # 23 once the partial one is dropped
        (50, 2, 6, True, False),  # 25
        (49, 2, 6, True, True),  # 24 once the partial one is dropped
        (12, 2, 6, False, True),
    ],
)
def test_epoch_keeps_steps(
    samples: int, batch: int, per_step: int, drop_last: bool, keeps: bool
) -> None:
    assert epoch_keeps_steps(samples, batch, per_step, drop_last=drop_last) is keeps


@pytest.mark.parametrize(
    ("world", "local", "expected"),
    [(2, 1, 3), (3, 1, 2), (1, 1, 6), (6, 1, 1), (4, 2, 3), (6, 2, 2)],  # (4, 2): 2 nodes
)
def test_accumulation_keeps_the_global_batch(world: int, local: int, expected: int) -> None:
    trainer = _trainer()
    message = apply_elastic(trainer, _env(world, local=local))
    assert trainer.args.gradient_accumulation_steps == expected
    assert message is not None and f"gradient_accumulation_steps 3 -> {expected}" in message
    # idempotent: a second train() finds the accumulation at this size already
    assert apply_elastic(trainer, _env(world, local=local)) == message.replace(
        "steps 3 ->", f"steps {expected} ->"
    )
    assert trainer.args.gradient_accumulation_steps == expected


def test_outside_an_elastic_attempt_nothing_changes() -> None:
    trainer = _trainer(accumulation=5)
    assert apply_elastic(trainer, {"WORLD_SIZE": "3"}) is None
    assert trainer.args.gradient_accumulation_steps == 5


@pytest.mark.parametrize(
    ("trainer", "env", "names"),
    [
        (_trainer(), _env(4), ["4 nodes cannot keep", "sizes that can: 1, 2, 3, 6"]),
        (_trainer(accumulation=2), _env(2), ["gradient_accumulation_steps=2", "accumulates 3"]),
        (_trainer(train_sampling_strategy="group_by_length"), _env(3), ["group_by_length"]),
        (_trainer(train_sampling_strategy="batch_rebalance"), _env(2), ["batch_rebalance"]),
        (_trainer(deepspeed="ds.json"), _env(3), ["DeepSpeed"]),
        # 46 rows: 23 micro-batches, 3 whole steps of 6; step 4 would differ by size
        (_trainer(samples=46), _env(3), ["46 samples", "12 samples", "max_steps <= 3"]),
        (_trainer(samples=46, max_steps=-1), _env(1), ["max_steps <= 3"]),
    ],
)
def test_refused_before_training_naming_the_fix(
    trainer: SimpleNamespace, env: dict[str, str], names: list[str]
) -> None:
    before = trainer.args.gradient_accumulation_steps
    with pytest.raises(ConfigurationError) as info:
        apply_elastic(trainer, env)
    for name in names:
        assert name in str(info.value)
    assert trainer.args.gradient_accumulation_steps == before


def test_an_epoch_not_reached_is_not_refused() -> None:
    trainer = _trainer(samples=46, max_steps=3)  # ends before the partial step
    assert apply_elastic(trainer, _env(3)) is not None
    assert trainer.args.gradient_accumulation_steps == 2


def test_a_dataset_without_length_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(samples=iter(range(48)))
    with caplog.at_level(logging.WARNING):
        apply_elastic(trainer, _env(3))
    assert trainer.args.gradient_accumulation_steps == 2
    assert "no length" in caplog.text


def _stock_trainer(tmp_path: Path, accumulation: int) -> Any:
    transformers = pytest.importorskip("transformers")
    import torch

    from trainer_runtime.hf.callback import attach

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.linear(x), labels)}

    data = [{"x": torch.randn(4), "labels": torch.randn(1)} for _ in range(24)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2,
        gradient_accumulation_steps=accumulation, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=data)
    attach(trainer, exit_on_preemption=False)
    return trainer


@pytest.fixture
def elastic_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREEMPTIBLE_ELASTIC_REFERENCE_NODES", "2")
    monkeypatch.setenv("PREEMPTIBLE_ELASTIC_ACCUMULATION", "3")


@pytest.mark.usefixtures("elastic_env")
def test_a_stock_trainer_on_one_node_accumulates_for_two(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer = _stock_trainer(tmp_path, accumulation=3)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.args.gradient_accumulation_steps == 6
    assert "elastic attempt on 1 of 2 reference node(s)" in caplog.text
    assert trainer.state.global_step == 2


@pytest.mark.usefixtures("elastic_env")
def test_a_stock_trainer_whose_accumulation_disagrees_is_refused_before_training(
    tmp_path: Path,
) -> None:
    trainer = _stock_trainer(tmp_path, accumulation=2)
    with pytest.raises(ConfigurationError, match="gradient_accumulation_steps=2"):
        trainer.train()
    assert trainer.state.global_step == 0
