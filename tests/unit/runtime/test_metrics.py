from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.metrics import TrainingMetrics, metrics_from_env
from trainer_runtime.protocol import (
    ENV_METRICS_HOST,
    ENV_METRICS_PORT,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    METRIC_NAMES,
    SaveTimings,
    StepTimings,
)

from .test_resume import make_trainer


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_gauges_served_from_own_registry() -> None:
    metrics = TrainingMetrics()
    metrics.serve(0, "127.0.0.1")
    try:
        assert metrics.port
        metrics.update(
            step=5,
            max_steps=10,
            epoch=0.5,
            step_seconds=StepTimings(last=0.1, ema=0.2, p99=0.3, max=0.4, count=5),
            save_seconds=SaveTimings(last=1.0, max=2.0, count=1),
            last_complete_checkpoint_step=4,
            stop_requested=True,
        )
        values = scrape(metrics.port)
    finally:
        metrics.close()
    assert set(METRIC_NAMES.values()) <= set(values)
    assert values[METRIC_NAMES["step"]] == 5
    assert values[METRIC_NAMES["step_seconds_p99"]] == 0.3
    assert values[METRIC_NAMES["save_seconds_max"]] == 2.0
    assert values[METRIC_NAMES["last_complete_checkpoint_step"]] == 4
    assert values[METRIC_NAMES["stop_requested"]] == 1
    # its own registry: no process/python default collectors
    assert not any(name.startswith("process_") for name in values)


def test_not_served_without_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_METRICS_PORT, raising=False)
    assert metrics_from_env() is None
    monkeypatch.setenv(ENV_METRICS_PORT, "not-a-port")
    assert metrics_from_env() is None


@pytest.mark.parametrize(("local_rank", "served"), [(None, True), ("0", True), ("1", False)])
def test_only_the_pods_main_process_serves(
    monkeypatch: pytest.MonkeyPatch, local_rank: str | None, served: bool
) -> None:
    """One /metrics per pod: torchrun's workers share the pod's one port; local rank 0 serves."""
    monkeypatch.setenv(ENV_METRICS_PORT, "0")
    monkeypatch.setenv(ENV_METRICS_HOST, "127.0.0.1")
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    metrics = metrics_from_env()
    try:
        assert (metrics is not None) is served
    finally:
        if metrics is not None:
            metrics.close()


def test_trainer_serves_metrics_while_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_OUTPUT_DIR, raising=False)
    monkeypatch.delenv(ENV_RESUME_FROM, raising=False)
    monkeypatch.setenv(ENV_METRICS_PORT, "0")  # any free port
    monkeypatch.setenv(ENV_METRICS_HOST, "127.0.0.1")
    seen: dict[str, float] = {}

    class Scrape(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                seen.update(scrape(trainer.metrics.port))  # type: ignore[union-attr]

    trainer = make_trainer(tmp_path, max_steps=4, save_steps=2)
    trainer.add_callback(Scrape())
    trainer.train()
    assert seen[METRIC_NAMES["step"]] == 3
    assert seen[METRIC_NAMES["max_steps"]] == 4
    assert seen[METRIC_NAMES["step_seconds_max"]] > 0
    assert seen[METRIC_NAMES["last_complete_checkpoint_step"]] == 2
    assert seen[METRIC_NAMES["save_seconds_last"]] > 0
    assert seen[METRIC_NAMES["stop_requested"]] == 0
    assert trainer.metrics is None  # server shut down after train()
