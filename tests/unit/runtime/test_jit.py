"""JIT checkpointing in-process: an injected latch and clock stand in for SIGTERM and time."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    ENV_TERMINATION_LOG,
    EXIT_PREEMPTED,
)
from trainer_runtime.signals import SigtermLatch
from trainer_runtime.trainer import Trainer

from .test_resume import assert_same_training, make_trainer
from .tiny import ClassificationData


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted(TrainerCallback):
    """Advances the fake clock one second per step; sends 'SIGTERM' at a chosen event/step."""

    def __init__(self, latch: SigtermLatch, clock: FakeClock, event: str, step: int) -> None:
        self.latch, self.clock, self.event, self.step = latch, clock, event, step
        self.saves: list[int] = []
        self.substeps = 0

    def _maybe(self, event: str, state: Any) -> None:
        if event == self.event and state.global_step == self.step and not self.latch.triggered:
            self.latch.trigger()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._maybe("on_train_begin", state)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.substeps += 1
        self._maybe("on_substep_end", state)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.clock.now += 1.0
        self._maybe("on_step_end", state)

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.saves.append(state.global_step)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT, ENV_TERMINATION_LOG):
        monkeypatch.delenv(name, raising=False)


def jit_trainer(
    out: Path, event: str, step: int, kill_wait: float = 0.0, grace: float | None = None, **kw: Any
) -> tuple[Trainer, Scripted]:
    trainer = make_trainer(out, enable_jit_checkpoint=True, **kw)
    clock = FakeClock()
    trainer.sigterm_latch = SigtermLatch(kill_wait=kill_wait, grace_seconds=grace, clock=clock)
    script = Scripted(trainer.sigterm_latch, clock, event, step)
    trainer.add_callback(script)
    return trainer, script


def test_waits_kill_wait_then_saves_and_returns(tmp_path: Path) -> None:
    trainer, script = jit_trainer(tmp_path / "run", "on_step_end", 3, kill_wait=3.0, save_steps=100)
    before = signal.getsignal(signal.SIGTERM)
    trainer.train()
    assert signal.getsignal(signal.SIGTERM) is before  # library mode: handler restored
    # SIGTERM at the end of step 3 (t=3); kill_wait 3 s at 1 s per step: stop after step 6.
    assert trainer.preempted and trainer.control.should_training_stop
    assert trainer.state.global_step == 6
    assert script.saves == [6]
    info = CheckpointStore(str(tmp_path / "run")).latest_complete()
    assert info is not None and info.step == 6
    record = json.loads((tmp_path / "run" / "checkpoint-6" / "preemptible_state.json").read_text())
    assert record["sigterm_to_exit_seconds"] == [3.0]

    full = make_trainer(tmp_path / "full", save_steps=100)
    full.train()
    resumed = make_trainer(tmp_path / "run", save_steps=100)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)
    # the measured stop time of the earlier attempt travels with the run
    assert resumed.sigterm_to_exit == [3.0]


def test_never_stops_inside_gradient_accumulation(tmp_path: Path) -> None:
    trainer, script = jit_trainer(
        tmp_path,
        "on_substep_end",
        2,
        dataset=ClassificationData(n=32),  # 8 micro-batches: 2 steps of 4 per epoch
        gradient_accumulation_steps=4,
        save_steps=100,
    )
    trainer.train()
    # SIGTERM after the first micro-batch of step 3: step 3 still runs all its 4 micro-batches.
    assert trainer.state.global_step == 3
    assert script.saves == [3]
    assert script.substeps == 3 * 3
    record = json.loads((tmp_path / "checkpoint-3" / "preemptible_state.json").read_text())
    assert record["data_position"]["epoch"] == 1
    assert record["data_position"]["batch"] == 4


def test_sigterm_during_periodic_save_does_not_save_twice(tmp_path: Path) -> None:
    trainer, script = jit_trainer(tmp_path, "on_step_end", 4, save_steps=4)
    trainer.train()
    assert trainer.preempted and trainer.state.global_step == 4
    assert script.saves == [4]


def test_sigterm_before_first_step_gives_resumable_step_zero(tmp_path: Path) -> None:
    trainer, script = jit_trainer(tmp_path / "run", "on_train_begin", 0, save_steps=100)
    trainer.train()
    assert trainer.preempted and trainer.state.global_step == 0
    assert script.saves == [0]
    info = CheckpointStore(str(tmp_path / "run")).latest_complete()
    assert info is not None and info.step == 0

    full = make_trainer(tmp_path / "full", save_steps=100)
    full.train()
    resumed = make_trainer(tmp_path / "run", save_steps=100)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)


def test_deadline_exceeded_is_logged_loudly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trainer, _ = jit_trainer(tmp_path, "on_step_end", 1, kill_wait=3.0, grace=2.0, save_steps=100)
    with caplog.at_level(logging.ERROR):
        trainer.train()
    assert "GRACE PERIOD EXCEEDED" in caplog.text


def test_jit_disabled_ignores_latch(tmp_path: Path) -> None:
    trainer, _ = jit_trainer(tmp_path, "on_step_end", 2, max_steps=5, save_steps=100)
    trainer.args.enable_jit_checkpoint = False
    trainer.train()
    assert not trainer.preempted and trainer.state.global_step == 5


def test_operator_exit_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    monkeypatch.setenv(ENV_ATTEMPT, "2")
    out = tmp_path / "out"
    trainer, _ = jit_trainer(out, "on_step_end", 2, save_steps=100)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_info:
            trainer.train()
        # exiting with 75: SIGTERM stays latched so a second one cannot kill the process
        assert signal.getsignal(signal.SIGTERM) == trainer.sigterm_latch._handle  # type: ignore[union-attr]
    finally:
        signal.signal(signal.SIGTERM, before)
    assert exit_info.value.code == EXIT_PREEMPTED
    msg = json.loads(log.read_text())
    assert msg["reason"] == "preempted" and msg["step"] == 2 and msg["complete"] is True
    assert msg["checkpoint"].endswith("checkpoint-2") and msg["attempt"] == 2
    assert msg["step_seconds"]["count"] == 2 and "sigterm_to_exit_seconds" in msg

    # the next attempt resumes and completes: exit protocol "completed", no exception
    monkeypatch.setenv(ENV_ATTEMPT, "3")
    done = make_trainer(out, max_steps=4, save_steps=100, enable_jit_checkpoint=True)
    try:
        done.train(resume_from_checkpoint=True)
        # finished under the operator: a late SIGTERM must not turn exit 0 into exit 143
        assert signal.getsignal(signal.SIGTERM) == done.sigterm_latch._handle  # type: ignore[union-attr]
    finally:
        signal.signal(signal.SIGTERM, before)
    msg = json.loads(log.read_text())
    assert msg["reason"] == "completed" and msg["step"] == 4 and msg["attempt"] == 3


def test_stop_on_the_last_step_is_a_completion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    monkeypatch.setenv(ENV_ATTEMPT, "1")
    trainer, _ = jit_trainer(tmp_path / "out", "on_step_end", 4, save_steps=100, max_steps=4)
    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer.train()  # no SystemExit(75): nothing is left to resume
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not trainer.preempted and trainer.state.global_step == 4
    msg = json.loads(log.read_text())
    assert msg["reason"] == "completed" and msg["step"] == 4


def test_operator_failure_is_reported_and_reraised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    monkeypatch.setenv(ENV_ATTEMPT, "1")

    class Boom(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                raise RuntimeError("disk on fire")

    trainer = make_trainer(tmp_path / "out", save_steps=100)
    trainer.add_callback(Boom())
    with pytest.raises(RuntimeError, match="disk on fire"):
        trainer.train()
    msg = json.loads(log.read_text())
    assert msg["reason"] == "failed" and msg["step"] == 2 and "disk on fire" in msg["message"]


def test_model_weights_change_only_on_full_steps(tmp_path: Path) -> None:
    """The JIT checkpoint holds the weights after the last full optimizer step."""
    trainer, _ = jit_trainer(tmp_path, "on_step_end", 2, save_steps=100)
    trainer.train()
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "checkpoint-2" / "model.safetensors"))
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(saved[name], tensor)
