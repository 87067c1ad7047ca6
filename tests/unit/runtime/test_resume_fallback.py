"""Resume from a corrupt checkpoint: it is marked, never chosen again, and the run falls back to
the previous complete checkpoint, bit-identical to an uninterrupted run (issue 31, item 3)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.checkpoint.layout import CORRUPT_NAME, CheckpointStore
from trainer_runtime.errors import CheckpointCorruptError
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    ENV_TERMINATION_LOG,
    read_termination_message,
)
from trainer_runtime.trainer import Trainer

from ..builders import StopAt
from .test_resume import assert_same_training, make_trainer


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT, ENV_TERMINATION_LOG):
        monkeypatch.delenv(name, raising=False)


def flip_byte(path: Path, offset: int = -3) -> None:
    """Same size, other bytes: what the completeness rule (sizes) cannot see."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


class StartStep(TrainerCallback):
    """The step training starts from (the checkpoint resumed from; 0 for a fresh start) and
    whether checkpoint-6 carried the corrupt marker then."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.marker: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.step = state.global_step
        path = Path(args.output_dir) / "checkpoint-6" / CORRUPT_NAME
        self.marker = json.loads(path.read_text()) if path.exists() else None


def resumed_trainer(out: Path, **overrides: object) -> tuple[Trainer, StartStep]:
    trainer = make_trainer(out, **overrides)
    start = StartStep()
    trainer.add_callback(start)
    return trainer, start


def saved_run(out: Path) -> None:
    """Checkpoints 2, 4 and 6 of one run (6 steps)."""
    make_trainer(out, max_steps=6, save_steps=2).train()


def uninterrupted(out: Path) -> Trainer:
    full = make_trainer(out, max_steps=6, save_steps=100)
    full.train()
    return full


@pytest.mark.parametrize(
    "damage",
    [
        # a flipped byte in the tensors: loads fine, only the checksum tells
        pytest.param(("model.safetensors", -3), id="checksum-only"),
        # a broken header: the load itself fails; reading it back against the manifest shows why
        pytest.param(("optimizer.safetensors", 9), id="unparseable"),
    ],
)
def test_corrupt_newest_checkpoint_is_marked_and_resume_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: tuple[str, int]
) -> None:
    full = uninterrupted(tmp_path / "full")
    out = tmp_path / "run"
    saved_run(out)
    name, offset = damage
    flip_byte(out / "checkpoint-6" / name, offset)

    resumed, start = resumed_trainer(out, max_steps=6, save_steps=100)
    with caplog.at_level(logging.ERROR):
        resumed.train(resume_from_checkpoint=True)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(
        "checkpoint-6" in m and "is corrupt" in m and name in m and "falling back" in m
        for m in errors
    ), caplog.text
    # resumed from checkpoint-4, with none of checkpoint-6's optimizer, schedule or RNG left
    assert start.step == 4
    assert_same_training(full, resumed)
    # it was marked before training went on (never chosen again by any reader of the rule) ...
    assert start.marker is not None and name in start.marker["reason"]
    # ... and this run's own save of step 6 replaced it
    info = CheckpointStore(str(out)).inspect("checkpoint-6")
    assert info.complete and not (out / "checkpoint-6" / CORRUPT_NAME).exists()


def test_marked_checkpoint_is_incomplete_for_every_reader(tmp_path: Path) -> None:
    saved_run(tmp_path)
    flip_byte(tmp_path / "checkpoint-6" / "model.safetensors")
    with pytest.raises(CheckpointCorruptError):
        make_trainer(tmp_path, max_steps=8).train(
            resume_from_checkpoint=str(tmp_path / "checkpoint-6")
        )
    store = CheckpointStore(str(tmp_path))
    info = store.inspect("checkpoint-6")
    assert not info.complete and info.corrupt and CORRUPT_NAME in (info.reason or "")
    assert "model.safetensors" in (info.reason or "")
    assert store.latest_complete().step == 4  # type: ignore[union-attr]
    from trainer_runtime.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-4")


def test_corrupt_checkpoint_asked_for_by_path_fails_without_substitute(tmp_path: Path) -> None:
    saved_run(tmp_path)
    flip_byte(tmp_path / "checkpoint-6" / "model.safetensors")
    trainer = make_trainer(tmp_path, max_steps=8)
    with pytest.raises(CheckpointCorruptError, match=r"checkpoint-6.*asked for by path"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    marker = json.loads((tmp_path / "checkpoint-6" / CORRUPT_NAME).read_text())
    assert "model.safetensors" in marker["reason"]
    assert trainer.state.global_step == 0  # nothing trained on another checkpoint's state


def test_operator_path_to_a_marked_checkpoint_resumes_from_the_one_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator keeps passing the newest checkpoint the runtime reported (it never steps
    # back): once marked, the runtime takes the newest complete one before it.
    full = uninterrupted(tmp_path / "full")
    out = tmp_path / "run"
    saved_run(out)
    flip_byte(out / "checkpoint-6" / "model.safetensors")
    monkeypatch.setenv(ENV_RESUME_FROM, str(out / "checkpoint-6"))
    first, start = resumed_trainer(out, max_steps=6, save_steps=100)
    first.add_callback(StopAt(5))  # preempted again: checkpoint-5
    first.train()  # loads checkpoint-6, finds it corrupt, marks it, falls back to 4
    assert start.step == 4
    again, start = resumed_trainer(out, max_steps=6, save_steps=100)
    again.train()  # the same path again: marked, so checkpoint-5 is chosen up front
    assert start.step == 5
    assert_same_training(full, again)


@pytest.mark.parametrize("corrupt", [True, False], ids=["fell-back", "as-asked"])
def test_termination_message_names_the_checkpoint_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, corrupt: bool
) -> None:
    """The operator asked for checkpoint-6; the message says what was loaded (checkpoint-4
    after a fallback), so the attempt's record and the lost-work count are right."""
    out = tmp_path / "run"
    saved_run(out)
    if corrupt:
        flip_byte(out / "checkpoint-6" / "model.safetensors")
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    monkeypatch.setenv(ENV_ATTEMPT, "2")
    monkeypatch.setenv(ENV_RESUME_FROM, str(out / "checkpoint-6"))
    make_trainer(out, max_steps=8, save_steps=100).train()
    msg = read_termination_message(log.read_text())
    assert msg is not None and msg.reason == "completed" and msg.step == 8
    expected = 4 if corrupt else 6
    assert msg.resumed_from == str(out / f"checkpoint-{expected}")
    assert msg.resumed_from_step == expected


def test_fresh_start_names_no_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv(ENV_TERMINATION_LOG, str(log))
    monkeypatch.setenv(ENV_ATTEMPT, "1")
    make_trainer(tmp_path / "run", max_steps=2, save_steps=100).train()
    msg = read_termination_message(log.read_text())
    assert msg is not None and msg.resumed_from is None and msg.resumed_from_step is None


def test_only_checkpoint_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_trainer(tmp_path, max_steps=2, save_steps=2).train()
    flip_byte(tmp_path / "checkpoint-2" / "model.safetensors")
    monkeypatch.setenv(ENV_RESUME_FROM, "latest")
    # The model already holds the corrupt weights: this process cannot start from scratch.
    with pytest.raises(CheckpointCorruptError, match="no complete checkpoint precedes it"):
        make_trainer(tmp_path, max_steps=3).train()
    # The next attempt starts from scratch: "latest" finds nothing complete, and the operator's
    # path to the marked checkpoint means the same.
    for resume_from in (str(tmp_path / "checkpoint-2"), "latest"):
        monkeypatch.setenv(ENV_RESUME_FROM, resume_from)
        fresh, start = resumed_trainer(tmp_path, max_steps=1, save_strategy="no")
        fresh.train()
        assert start.step == 0 and fresh.state.log_history[0]["step"] == 1


def test_a_load_error_that_is_not_corruption_is_raised_and_marks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved_run(tmp_path)

    def refuse(self: Trainer, info: object) -> None:
        raise RuntimeError("size mismatch for weight: this model does not fit")

    monkeypatch.setattr(Trainer, "_load_checkpoint", refuse)
    with pytest.raises(RuntimeError, match="size mismatch"):
        make_trainer(tmp_path, max_steps=8).train(resume_from_checkpoint=True)
    # read back against its manifest, checkpoint-6 is intact: not marked, still the newest
    assert not (tmp_path / "checkpoint-6" / CORRUPT_NAME).exists()
    assert CheckpointStore(str(tmp_path)).latest_complete().step == 6  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("damage", "finding"),
    [
        (lambda d: (d / "optimizer.safetensors").unlink(), "file optimizer.safetensors missing"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "manifest.json is unreadable"),
    ],
    ids=["listed-file-gone", "manifest-unreadable"],
)
def test_a_checkpoint_damaged_between_the_choice_and_the_load_is_marked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage, finding: str
) -> None:  # type: ignore[no-untyped-def]
    full = uninterrupted(tmp_path / "full")
    out = tmp_path / "run"
    saved_run(out)
    real = Trainer._load_checkpoint

    def damaged_then_loaded(self: Trainer, info) -> None:  # type: ignore[no-untyped-def]
        if info.step == 6:
            damage(out / "checkpoint-6")  # after the choice, before the load
        real(self, info)

    monkeypatch.setattr(Trainer, "_load_checkpoint", damaged_then_loaded)
    resumed, start = resumed_trainer(out, max_steps=6, save_steps=100)
    resumed.train(resume_from_checkpoint=True)
    assert start.step == 4 and start.marker is not None and finding in start.marker["reason"]
    assert_same_training(full, resumed)
