from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainer_runtime.callbacks import EVENTS, CallbackHandler, DefaultFlowCallback, TrainerCallback
from trainer_runtime.protocol import ENV_OUTPUT_DIR, ENV_RESUME_FROM
from trainer_runtime.state import TrainerControl, TrainerState

from .test_resume import make_trainer


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_OUTPUT_DIR, raising=False)
    monkeypatch.delenv(ENV_RESUME_FROM, raising=False)


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict[str, float]] = []


def _recording(event: str) -> Any:
    def method(self: Recorder, args: Any, state: TrainerState, control: Any, **kw: Any) -> None:
        self.events.append((event, state.global_step))
        if event == "on_log":
            self.logs.append(kw["logs"])

    return method


for _e in EVENTS:
    setattr(Recorder, _e, _recording(_e))


def test_event_order_of_a_run(tmp_path: Path) -> None:
    rec = Recorder()
    # 16 samples, bs 4, GA 2: 2 steps per epoch; 1 epoch
    from .tiny import ClassificationData

    trainer = make_trainer(
        tmp_path,
        ClassificationData(n=16),
        num_train_epochs=1,
        save_steps=2,
        logging_steps=2,
        warmup_steps=0,
    )
    trainer.add_callback(rec)
    trainer.train()
    names = [e for e, _ in rec.events]
    step_events = [
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
    ]
    assert names == [
        "on_train_begin",
        "on_epoch_begin",
        *step_events,
        *step_events,
        "on_log",
        "on_save",
        "on_epoch_end",
        # the end-of-training summary goes through on_log before on_train_end (as transformers)
        "on_log",
        "on_train_end",
    ]
    assert {"train_runtime", "train_loss", "total_flos", "train_samples_per_second"} <= set(
        rec.logs[-1]
    )
    assert (
        rec.logs[0]["loss"] > 0 and "learning_rate" in rec.logs[0] and rec.logs[0]["epoch"] == 1.0
    )
    assert trainer.state.log_history[0]["step"] == 2


def test_add_pop_remove() -> None:
    handler = CallbackHandler([DefaultFlowCallback])
    rec = Recorder()
    handler.add_callback(rec)
    handler.add_callback(Recorder)
    assert handler.callback_list.splitlines() == ["DefaultFlowCallback", "Recorder", "Recorder"]
    assert handler.pop_callback(rec) is rec
    popped = handler.pop_callback(Recorder)
    assert isinstance(popped, Recorder) and popped is not rec
    handler.add_callback(rec)
    handler.remove_callback(Recorder)
    assert handler.callback_list == "DefaultFlowCallback"
    assert handler.pop_callback(Recorder) is None


def test_callback_can_replace_control() -> None:
    class Replace(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> TrainerControl:
            return TrainerControl(should_training_stop=True)

    handler = CallbackHandler([Replace()])
    control = handler.on_step_end(None, TrainerState(), TrainerControl())
    assert control.should_training_stop


def test_callback_can_stop_training(tmp_path: Path) -> None:
    class Stop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                control.should_training_stop = True

    trainer = make_trainer(tmp_path, save_strategy="no")
    trainer.add_callback(Stop)
    out = trainer.train()
    assert out.global_step == 2
    assert not list(tmp_path.iterdir())  # save_strategy="no": nothing written


def test_logged_learning_rate_is_the_rate_of_the_step(tmp_path: Path) -> None:
    """transformers logs the rate the optimizer step used (read before scheduler.step()), not
    the next step's: with a linear schedule and no warmup step 1 logs the full rate."""
    from .tiny import ClassificationData

    trainer = make_trainer(
        tmp_path,
        ClassificationData(n=16),
        gradient_accumulation_steps=1,
        max_steps=4,
        lr_scheduler_type="linear",
        warmup_steps=0,
        learning_rate=0.1,
        save_strategy="no",
        max_grad_norm=0.0,
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["learning_rate"] for e in logs] == pytest.approx([0.1, 0.075, 0.05, 0.025])
    # max_grad_norm=0 clips nothing but the norm is still logged (as transformers)
    assert all(e["grad_norm"] > 0 for e in logs)
    assert list(logs[0])[:3] == ["loss", "grad_norm", "learning_rate"]


def test_callback_stop_mid_epoch_still_ends_the_epoch(tmp_path: Path) -> None:
    """A callback that stops training mid-epoch: on_epoch_end runs (so epoch strategies save),
    then the summary goes through on_log, then on_train_end."""
    from .tiny import ClassificationData

    class StopAt(Recorder):
        def on_step_end(self, args: Any, state: TrainerState, control: Any, **kw: Any) -> Any:
            self.events.append(("on_step_end", state.global_step))
            if state.global_step == 1:
                control.should_training_stop = True
            return control

    rec = StopAt()
    trainer = make_trainer(
        tmp_path, ClassificationData(n=32), num_train_epochs=2, save_strategy="epoch"
    )
    trainer.add_callback(rec)
    trainer.train()
    names = [e for e, _ in rec.events]
    # the epoch strategy's save happens at that epoch end
    assert names[-4:] == ["on_epoch_end", "on_save", "on_log", "on_train_end"]
    assert names.count("on_epoch_end") == 1
    assert (tmp_path / "checkpoint-1").is_dir()
    summary = rec.logs[-1]
    assert set(summary) >= {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
        "epoch",
    }
    assert trainer.state.log_history[-1]["step"] == 1


def test_pop_callback_accepts_transformers_class_of_a_builtin() -> None:
    """Scripts written for transformers pop ``transformers.PrinterCallback`` (or
    ProgressCallback) from the Trainer: that removes our built-in callback of the same name."""
    transformers = pytest.importorskip("transformers")
    from trainer_runtime.callbacks import CallbackHandler, DefaultFlowCallback, PrinterCallback

    handler = CallbackHandler([DefaultFlowCallback, PrinterCallback])
    popped = handler.pop_callback(transformers.PrinterCallback)
    assert isinstance(popped, PrinterCallback)
    assert [type(cb) for cb in handler.callbacks] == [DefaultFlowCallback]
    handler.remove_callback(transformers.DefaultFlowCallback)
    assert handler.callbacks == []
    # a user's class that merely shares a name is not taken for ours
    other = type("PrinterCallback", (transformers.TrainerCallback,), {"__module__": "user"})
    handler.add_callback(PrinterCallback)
    assert handler.pop_callback(other) is None
