"""save_async: periodic checkpoints written by a background thread, in process.

The real-process counterpart (SIGKILLs during background writes) is
tests/runtime/test_async_save_sigkill.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.checkpoint.background import resolve_save_async
from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM

from .test_jit import jit_trainer
from .test_resume import assert_same_training, make_trainer

# every file of every checkpoint but the records holding wall-clock timings (and the arguments,
# which differ in save_async)
_TIMED = {"manifest.json", "preemptible_state.json", "training_args.json"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def slow_writer(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Files written off the main thread take 0.1 s each; records (step, file) of those."""
    written: list[tuple[int, str]] = []
    real = CheckpointWriter.write_entry

    def slow(self: CheckpointWriter, filename: str, data: Any, **kw: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.1)
            written.append((self.step, filename))
        real(self, filename, data, **kw)

    monkeypatch.setattr(CheckpointWriter, "write_entry", slow)
    return written


class StepsDuringWrite(TrainerCallback):
    """Records the steps that end while a background write is in flight."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.steps: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        save = self.trainer._async_save
        if save is not None and not save.done():
            self.steps.append(state.global_step)


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in _TIMED
    }


def test_background_checkpoints_are_byte_identical_to_blocking_ones(
    tmp_path: Path, slow_writer: list[tuple[int, str]]
) -> None:
    blocking = make_trainer(tmp_path / "sync", save_async=False)
    blocking.train()
    assert not slow_writer
    background = make_trainer(tmp_path / "async", save_async=True)
    during = StepsDuringWrite(background)
    background.add_callback(during)
    background.train()
    assert slow_writer, "no file was written by the background thread"
    # training went on while checkpoints were written (the state was snapshotted)
    assert during.steps, "no step ran while a checkpoint was being written"
    assert_same_training(blocking, background)
    ours = CheckpointStore(str(tmp_path / "async")).list()
    assert [c.step for c in ours] == [
        c.step for c in CheckpointStore(str(tmp_path / "sync")).list()
    ]
    assert all(c.complete for c in ours), ours
    assert _files(tmp_path / "async") == _files(tmp_path / "sync")
    assert background.save_timer.count == len(ours)


def test_resume_from_a_background_checkpoint_is_bit_identical(tmp_path: Path) -> None:
    full = make_trainer(tmp_path / "full", save_async=False)
    full.train()
    first = make_trainer(tmp_path / "run", save_async=True)
    first.train()
    assert_same_training(full, first)
    resumed = make_trainer(tmp_path / "run", save_async=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-8"))
    assert_same_training(full, resumed)


def test_jit_stop_supersedes_a_background_write_of_an_earlier_step(
    tmp_path: Path, slow_writer: list[tuple[int, str]]
) -> None:
    trainer, script = jit_trainer(tmp_path / "out", "on_step_end", 5, save_async=True)
    trainer.train()
    assert trainer.preempted and trainer.state.global_step == 5
    store = CheckpointStore(str(tmp_path / "out"))
    by_step = {c.step: c for c in store.list()}
    # checkpoint-4's write was cancelled, its directory removed once checkpoint-5 was committed
    assert 4 not in by_step, by_step.get(4)
    assert any(step == 4 for step, _ in slow_writer), "checkpoint-4 was being written"
    assert by_step[5].complete
    assert store.latest_complete().step == 5  # type: ignore[union-attr]
    assert script.saves == [5]
    # the JIT save's measured time covers the cancellation of the write in flight
    assert trainer.save_timer.last is not None
    assert trainer.save_timer.last >= by_step[5].save_seconds  # type: ignore[operator]
    # the resumed run continues exactly
    full = make_trainer(tmp_path / "full", save_async=False)
    full.train()
    resumed = make_trainer(tmp_path / "out", save_async=True)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)


def test_sigterm_while_a_periodic_save_waits_behind_a_write_stops_without_waiting(
    tmp_path: Path, slow_writer: list[tuple[int, str]]
) -> None:
    # SIGTERM after step 6, kill_wait 2 s at 1 s per step: the stop is due at step 8, where a
    # periodic save would first wait for checkpoint-4's write (at most one in flight). The
    # stop does not wait: checkpoint-8 is the JIT checkpoint and checkpoint-4 is superseded.
    trainer, script = jit_trainer(
        tmp_path / "out", "on_step_end", 6, kill_wait=2.0, save_async=True
    )
    trainer.train()
    assert trainer.preempted and trainer.state.global_step == 8
    by_step = {c.step: c for c in CheckpointStore(str(tmp_path / "out")).list()}
    assert any(step == 4 for step, _ in slow_writer), "checkpoint-4 was being written"
    assert 4 not in by_step, "the stop waited for checkpoint-4's write instead of superseding it"
    assert by_step[8].complete and script.saves == [8]
    full = make_trainer(tmp_path / "full", save_async=False)
    full.train()
    resumed = make_trainer(tmp_path / "out", save_async=True)
    resumed.train(resume_from_checkpoint=True)
    assert_same_training(full, resumed)


def test_jit_stop_at_the_step_of_the_write_in_flight_waits_for_it(
    tmp_path: Path, slow_writer: list[tuple[int, str]]
) -> None:
    trainer, script = jit_trainer(tmp_path / "out", "on_step_end", 4, save_async=True)
    trainer.train()
    assert trainer.preempted and trainer.state.global_step == 4
    info = CheckpointStore(str(tmp_path / "out")).latest_complete()
    assert info is not None and info.step == 4
    assert script.saves == [4], "one checkpoint of step 4, committed once"
    assert trainer.save_timer.count == 1


def _args(**kw: Any) -> SimpleNamespace:
    base = {
        "save_async": None,
        "save_on_each_node": False,
        "save_strategy": "steps",
        "load_best_model_at_end": False,
        "push_to_hub": False,
    }
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("args", "operator", "world", "fsdp", "expected"),
    [
        (_args(), True, 1, False, True),
        (_args(), False, 1, False, False),  # plain library: transformers' on_save timing
        (_args(), True, 2, False, False),
        (_args(), True, 1, True, False),
        (_args(save_strategy="best"), True, 1, False, False),
        (_args(load_best_model_at_end=True), True, 1, False, False),
        (_args(push_to_hub=True), True, 1, False, False),
        (_args(save_async=True), False, 1, False, True),
        (_args(save_async=True), False, 2, False, True),
        (_args(save_async=False), True, 1, False, False),
        (_args(save_async=False), True, 1, True, False),
        # FSDP: each rank snapshots and writes its own shards
        (_args(save_async=True), True, 2, True, True),
    ],
)
def test_resolve_save_async(
    args: SimpleNamespace, operator: bool, world: int, fsdp: bool, expected: bool
) -> None:
    assert resolve_save_async(args, operator=operator, world_size=world, fsdp=fsdp) is expected


@pytest.mark.parametrize(
    ("args", "fsdp", "match"),
    [
        (_args(save_async=True, save_on_each_node=True), False, "save_on_each_node"),
    ],
)
def test_save_async_refused_where_the_writer_is_collective(
    args: SimpleNamespace, fsdp: bool, match: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"save_async=True.*{match}"):
        resolve_save_async(args, operator=True, world_size=2, fsdp=fsdp)


def test_a_slow_background_write_does_not_switch_jit_saves_off(
    tmp_path: Path, slow_writer: list[tuple[int, str]]
) -> None:
    """Background writes compete with training for CPU and disk: their time is not what a JIT
    save takes, so it must not make a JIT save "not fit" (it used to: one slow background write
    turned every later JIT stop into deadline_too_short)."""
    # checkpoint-4 is written in the background (0.1 s per file) and committed when the save of
    # step 8 begins; SIGTERM after step 9, with 0.3 s of grace
    trainer, _ = jit_trainer(
        tmp_path / "out", "on_step_end", 9, grace=0.3, save_async=True, save_steps=4
    )
    trainer.train()
    assert slow_writer, "the periodic save was not written in the background"
    assert trainer.save_timer.count >= 2  # the background checkpoint-4, the JIT checkpoint-9
    assert trainer.save_timer.max is not None and trainer.save_timer.max > 0.3
    assert trainer.preempted and trainer._jit_stop_kind != "no_save"
    latest = CheckpointStore(str(tmp_path / "out")).latest_complete()
    assert latest is not None and latest.step == 9, latest
    # the JIT save blocked training: it is what the next JIT estimate comes from
    assert trainer.save_timer.recent_blocking and trainer.save_timer.jit_estimate is not None


def test_without_a_jit_save_a_background_write_is_not_waited_for_past_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = CheckpointWriter.write_entry

    def very_slow(self: CheckpointWriter, filename: str, data: Any, **kw: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(2.0)  # the background write of checkpoint-4 takes many seconds
        real(self, filename, data, **kw)

    monkeypatch.setattr(CheckpointWriter, "write_entry", very_slow)
    trainer, _ = jit_trainer(
        tmp_path / "out", "on_step_end", 5, grace=3.0, save_async=True, save_steps=4
    )
    trainer.save_timer.record(60.0)  # a blocking save took a minute: no JIT save fits 3 s
    started = time.monotonic()
    trainer.train()
    # SIGTERM at the end of step 5: 3 s of grace, 2 s kept for the exit: about 1 s of waiting
    assert time.monotonic() - started < 8.0
    assert trainer.preempted and trainer._jit_stop_kind == "no_save"
    store = CheckpointStore(str(tmp_path / "out"))
    assert store.latest_complete() is None  # the write in flight was cancelled, not committed


class HeldAtSave(TrainerCallback):
    """The snapshot memory a trainer still holds when each checkpoint is committed (its
    background write is over by then)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.held: list[int] = []

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.held.append(self.trainer._snapshot_buffers.held_bytes)


@pytest.mark.parametrize("keep", [None, False, True])  # None: the argument left out
def test_snapshot_memory_is_given_back_or_kept_between_saves(
    tmp_path: Path, keep: bool | None
) -> None:
    extra = {} if keep is None else {"save_async_keep_snapshot": keep}
    trainer = make_trainer(tmp_path / "run", save_async=True, **extra)
    held = HeldAtSave(trainer)
    trainer.add_callback(held)
    trainer.train()
    assert len(held.held) >= 2
    # given back once the files are written (the default), or kept (model, optimizer and RNG
    # state: a few KiB each, rounded to pages)
    assert all(h > 0 for h in held.held) if keep else all(h == 0 for h in held.held)
    assert trainer._snapshot_buffers.held_bytes == 0  # train() gives it all back at its end
