"""The checkpoint manager's own decisions (checkpointing.py, issue 38 item 6): how a resume was
asked for and what a corrupt checkpoint then falls back to, where the optimizer state of a resume
comes from, and which save supersedes a background write in flight. The end-to-end behaviour is
tested through the Trainer (test_resume*.py, test_save_async.py, tests/runtime)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from trainer_runtime.checkpoint.layout import CheckpointInfo
from trainer_runtime.checkpointing import (
    CheckpointManager,
    keeps_newer,
    loaded_optimizer_source,
    may_fall_back,
    resume_mode,
    supersedes,
)
from trainer_runtime.protocol import ENV_RESUME_FROM


@pytest.mark.parametrize(
    ("resume", "from_env", "mode", "falls_back", "keeps"),
    [
        (None, False, None, True, False),
        (False, False, None, True, False),
        (True, False, "latest", True, False),
        (True, True, "latest_env", True, False),
        ("/out/checkpoint-4", False, "path", False, True),
        ("/out/checkpoint-4", True, "env_path", True, True),
    ],
)
def test_resume_mode_decides_fallback_and_keeping(
    resume: bool | str | None, from_env: bool, mode: str | None, falls_back: bool, keeps: bool
) -> None:
    assert resume_mode(resume, from_env=from_env) == mode
    # only a caller's own path refuses a substitute for a corrupt checkpoint
    assert may_fall_back(mode) is falls_back  # type: ignore[arg-type]
    # only a path may be older than complete checkpoints already there
    assert keeps_newer(mode) is keeps  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("jit", "pending_step", "step", "cancels"),
    [
        (False, 10, 12, False),  # a periodic save waits for the older write and commits it
        (False, 12, 12, False),
        (True, 12, 12, False),  # the JIT save of the step being written: commit it
        (True, 10, 12, True),  # the JIT save of a newer step supersedes the older write
    ],
)
def test_which_save_supersedes_a_pending_write(
    jit: bool, pending_step: int, step: int, cancels: bool
) -> None:
    assert supersedes(jit=jit, pending_step=pending_step, step=step) is cancels


@pytest.mark.parametrize(
    ("sharded", "ours", "scheduler", "hf_opt", "hf_sched", "source"),
    [
        (None, True, True, False, False, "ours"),
        (None, True, True, True, True, "ours"),  # ours wins over an export beside it
        (None, False, False, True, True, "transformers"),
        (None, True, False, True, True, "transformers"),  # no scheduler.json: theirs, whole
        (None, False, False, True, False, "none"),
        (None, False, True, False, False, "none"),
        (True, False, True, False, False, "ours"),  # FSDP pieces held the optimizer
        (False, True, True, True, True, "none"),  # FSDP without optimizer: never torch files
        (True, False, False, True, True, "none"),
    ],
)
def test_where_a_resume_takes_the_optimizer_from(
    sharded: bool | None, ours: bool, scheduler: bool, hf_opt: bool, hf_sched: bool, source: str
) -> None:
    assert (
        loaded_optimizer_source(
            sharded_optimizer=sharded,
            has_ours=ours,
            has_scheduler=scheduler,
            has_hf_optimizer=hf_opt,
            has_hf_scheduler=hf_sched,
        )
        == source
    )


# -- the manager with a stand-in Trainer and background write (one process) -----------------------
@dataclass
class _Writer:
    step: int
    path: str = ""
    name: str = ""
    committed: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = f"checkpoint-{self.step}"
        self.path = f"/out/{self.name}"

    def commit(self, extra: dict[str, Any]) -> CheckpointInfo:
        self.committed.append(self.step)
        return CheckpointInfo(
            path=self.path,
            name=self.name,
            step=self.step,
            complete=True,
            reason=None,
            size_bytes=1,
            manifest={},
            attempt=0,
        )


class _Pending:
    """A background write that has finished its files (BackgroundSave's surface)."""

    def __init__(self, step: int) -> None:
        self.writer = _Writer(step)
        self.step = step
        self.error: BaseException | None = None
        self.cancelled = False
        self.seconds = 0.5

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None

    def cancel(self) -> None:
        self.cancelled = True


class _Host:
    def __init__(self, step: int) -> None:
        self.args = SimpleNamespace(output_dir="/out", save_async_keep_snapshot=None)
        self.accelerator = SimpleNamespace(local_process_index=0)
        self.state = SimpleNamespace(global_step=step)
        self.commits: list[tuple[int, bool]] = []

    def _manifest_extra(self) -> dict[str, Any]:
        return {}

    def _after_checkpoint_commit(
        self, info: CheckpointInfo, seconds: float, *, blocking: bool = True
    ) -> None:
        self.commits.append((info.step, blocking))


@pytest.mark.parametrize(("jit", "pending_step"), [(False, 10), (True, 12), (True, 10)])
def test_settling_a_pending_write_before_a_save(jit: bool, pending_step: int) -> None:
    host = _Host(step=12)
    manager = CheckpointManager(host)  # type: ignore[arg-type]
    pending = _Pending(pending_step)
    manager.in_flight = pending  # type: ignore[assignment]
    manager._settle(jit=jit)
    assert manager.in_flight is None  # at most one write: never two in flight
    if supersedes(jit=jit, pending_step=pending_step, step=12):
        assert pending.cancelled and pending.writer.committed == []
        assert manager._superseded is pending  # removed once the JIT checkpoint is committed
        assert host.commits == []
    else:
        assert not pending.cancelled and pending.writer.committed == [pending_step]
        assert host.commits == [(pending_step, False)]  # a background write: not blocking
        assert manager._superseded is None


def test_resolve_resets_what_an_earlier_train_call_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_RESUME_FROM, raising=False)
    manager = CheckpointManager(_Host(step=0))  # type: ignore[arg-type]
    manager.mode, manager.keep_complete_after = "path", 7
    assert manager.resolve(False) is None
    assert manager.mode is None and manager.keep_complete_after is None
    assert manager.kept_checkpoint(9) is None  # nothing kept: save as usual, nothing read
