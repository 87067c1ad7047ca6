"""A resume reads the optimizer file into a buffer faulted in while the model file is read
(issue 38.5), where the process has a second core: the Trainer asks for it, the loaded state
lives in it, and the run stays bit-identical to an uninterrupted one; with one CPU it asks for
nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.checkpoint.io import CheckpointReader
from trainer_runtime.checkpoint.model_state import OPTIMIZER_NAME
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM

from ..builders import StopAt
from .test_resume import assert_same_training, make_trainer


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)


class _StateAtFirstStep(TrainerCallback):
    """The optimizer's state tensors as the resume left them (before any step changes them)."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.tensors: list[torch.Tensor] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if not self.tensors:
            for entry in self.trainer.optimizer.state.values():
                self.tensors += [v for v in entry.values() if v.numel() > 1]


@pytest.mark.parametrize("cpus", [16, 1])
def test_resume_reads_the_optimizer_into_the_prepared_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    prepared: dict[str, torch.Tensor] = {}
    real = CheckpointReader.prepare_owned

    def spy(self: CheckpointReader, filename: str) -> None:
        real(self, filename)
        prepared[filename] = self._prepared[filename]  # the very buffer

    monkeypatch.setattr(CheckpointReader, "prepare_owned", spy)
    full = make_trainer(tmp_path / "full")
    full.train()
    assert not prepared  # saving prepares nothing
    first = make_trainer(tmp_path / "run")
    first.add_callback(StopAt(5))
    first.train()

    resumed = make_trainer(tmp_path / "run")
    grab = _StateAtFirstStep()
    grab.trainer = resumed
    resumed.add_callback(grab)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)
    if cpus < 2:
        assert not prepared
        return
    assert list(prepared) == [OPTIMIZER_NAME]
    buf = prepared[OPTIMIZER_NAME]
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    assert grab.tensors and all(lo <= t.data_ptr() < hi for t in grab.tensors)
