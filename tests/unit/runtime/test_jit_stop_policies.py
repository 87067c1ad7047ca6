"""The micro-batch stop, the save that cannot fit, and the operator's save interval, in-process
(an injected latch and clock stand in for SIGTERM and time; tests/runtime has the real signals)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import ENV_SAVE_INTERVAL_SECONDS

from .test_jit import _clean_env, jit_trainer  # noqa: F401  (autouse fixture)
from .test_resume import assert_same_training, make_trainer
from .tiny import ClassificationData

GA = {"dataset": ClassificationData(n=32), "gradient_accumulation_steps": 4, "save_steps": 100}


def test_micro_batch_policy_drops_the_partial_step_and_resumes_identically(tmp_path: Path) -> None:
    # SIGTERM after the first micro-batch of step 3 (kill_wait 0): that boundary drops it.
    trainer, script = jit_trainer(
        tmp_path / "run", "on_substep_end", 2, jit_stop_policy="micro_batch", **GA
    )
    trainer.train()
    assert trainer.preempted and trainer.state.global_step == 2
    assert script.saves == [2]
    # step 1 and 2: 3 boundaries each; step 3: the first one (SIGTERM, then the drop)
    assert script.substeps == 2 * 3 + 1
    record = json.loads((tmp_path / "run" / "checkpoint-2" / "preemptible_state.json").read_text())
    # Epoch 0 (8 micro-batches) ended with step 2; step 3's 4 micro-batches are given back.
    assert (record["data_position"]["epoch"], record["data_position"]["batch"]) == (1, 0)

    full = make_trainer(tmp_path / "full", **GA)
    full.train()
    resumed = make_trainer(tmp_path / "run", **GA)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)


def test_finish_step_falls_back_when_the_rest_of_the_step_misses_the_deadline(
    tmp_path: Path,
) -> None:
    # The fake clock moves 1 s per step; every micro-batch measures ~0 s of real time, so the
    # estimate is the step's own pace: fits a 10 s grace, not a deadline already past.
    trainer, _ = jit_trainer(tmp_path / "a", "on_substep_end", 2, grace=10.0, **GA)
    trainer.train()
    assert trainer.state.global_step == 3, "the rest of the step fits: finished"
    trainer, _ = jit_trainer(tmp_path / "b", "on_substep_end", 2, grace=0.0, **GA)
    trainer.train()
    assert trainer.state.global_step == 2 and trainer._jit_stop_kind == "micro_batch"


class _SlowSteps(TrainerCallback):
    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        time.sleep(0.05)


def test_a_save_that_cannot_fit_is_not_started(tmp_path: Path) -> None:
    trainer, script = jit_trainer(tmp_path, "on_step_end", 5, grace=0.5, save_steps=4)
    # The periodic save of step 4 is measured; pretend it took 2 s: more than the 0.5 s left.
    trainer.save_timer.record(2.0)
    trainer.train()
    assert trainer.preempted and trainer._jit_stop_kind == "no_save"
    assert script.saves == [4], "no JIT save may be started"
    assert [c.step for c in CheckpointStore(str(tmp_path)).list()] == [4]
    assert trainer._deadline_message and "deadline too short" in trainer._deadline_message


def test_operator_interval_adds_time_based_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_SAVE_INTERVAL_SECONDS, "0.2")
    trainer = make_trainer(tmp_path, max_steps=12, save_steps=100)
    trainer.add_callback(_SlowSteps())
    saved: list[int] = []
    times: list[float] = []

    class Saves(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            saved.append(state.global_step)
            times.append(time.monotonic())

    trainer.add_callback(Saves())
    trainer.train()
    # 12 steps of >= 50 ms with a 0.2 s interval: a save every ~4 steps at most (plus the final
    # one); in time (steps are slower on a loaded machine), never two within the interval.
    assert len(saved) >= 3 and saved[-1] == 12, saved
    assert all(s < 12 for s in saved[:-1]), saved
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(g >= 0.2 for g in gaps[:-1]), f"saved more often than every 0.2 s: {saved} {gaps}"


class _TermDuringEval(TrainerCallback):
    """'SIGTERM' at the first evaluation batch of step ``step``; records evaluations."""

    def __init__(self, latch: Any, step: int) -> None:
        self.latch, self.step = latch, step
        self.evaluated: list[int] = []

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step and not self.latch.triggered:
            self.latch.trigger()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.evaluated.append(state.global_step)


EVAL = {"eval_strategy": "no", "save_steps": 100, "max_steps": 6}


def _eval_trainer(out: Path, **kw: Any) -> Any:
    """make_trainer's configuration, with an evaluation set (needed at construction)."""
    from trainer_runtime.trainer import Trainer

    base = make_trainer(out, **EVAL, **kw)
    torch.manual_seed(1)  # the same initial weights as make_trainer's model
    return Trainer(
        model=type(base.model)(),
        args=dataclasses.replace(base.args, eval_strategy="steps", eval_steps=2),
        train_dataset=base.train_dataset,
        eval_dataset=ClassificationData(n=16),
    )


def test_evaluation_abandoned_and_run_again_after_resume(tmp_path: Path) -> None:
    from trainer_runtime.signals import SigtermLatch

    trainer = _eval_trainer(tmp_path / "run", enable_jit_checkpoint=True)
    trainer.sigterm_latch = SigtermLatch(kill_wait=0.0)
    term = _TermDuringEval(trainer.sigterm_latch, 4)
    trainer.add_callback(term)
    trainer.train()
    assert trainer.preempted and trainer.state.global_step == 4
    assert trainer._jit_stop_kind == "evaluation" and term.evaluated == [2]
    record = json.loads((tmp_path / "run" / "checkpoint-4" / "preemptible_state.json").read_text())
    assert record["pending_evaluation"] == {"skip_scheduler": False}

    full = _eval_trainer(tmp_path / "full")
    full_evals = _TermDuringEval(SigtermLatch(kill_wait=0.0), -1)
    full.add_callback(full_evals)
    full.train()
    resumed = _eval_trainer(tmp_path / "run")
    resumed_evals = _TermDuringEval(SigtermLatch(kill_wait=0.0), -1)
    resumed.add_callback(resumed_evals)
    resumed.train(resume_from_checkpoint=True)
    assert resumed_evals.evaluated == [4, 6], "the abandoned evaluation of step 4 runs first"
    assert full_evals.evaluated == [2, 4, 6]
    assert_same_training(full, resumed)
    # the same metrics as the uninterrupted run's evaluation of step 4
    full_4 = [e for e in full.state.log_history if "eval_loss" in e and e["step"] == 4]
    resumed_4 = [e for e in resumed.state.log_history if "eval_loss" in e and e["step"] == 4]
    assert full_4[0]["eval_loss"] == resumed_4[-1]["eval_loss"]
