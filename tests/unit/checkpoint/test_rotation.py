"""Rotation (save_total_limit): decisions as a pure table, then on real directories."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from fsspec import register_implementation
from fsspec.implementations.memory import MemoryFileSystem

from trainer_runtime.checkpoint.io import CheckpointWriter, rotate_checkpoints
from trainer_runtime.checkpoint.layout import (
    SENTINEL_NAME,
    CheckpointInfo,
    CheckpointStore,
    rotation_victims,
)
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import CheckpointError, ConfigurationError


def _ckpts(spec: str) -> list[CheckpointInfo]:
    """'10 20 30i 40i@2 50c' -> checkpoints at steps 10, 20 (complete), 30 (incomplete), 40
    (incomplete, started by attempt 2) and 50 (marked corrupt by a resume)."""
    out = []
    for token in spec.split():
        token, _, attempt = token.partition("@")
        corrupt = token.endswith("c")
        incomplete = token.endswith("i") or corrupt
        step = int(token.rstrip("ic"))
        out.append(
            CheckpointInfo(
                f"/o/checkpoint-{step}",
                f"checkpoint-{step}",
                step,
                not incomplete,
                "sentinel" if incomplete else None,
                1,
                None,
                int(attempt) if attempt else None,
                corrupt,
            )
        )
    return out


@pytest.mark.parametrize(
    ("spec", "limit", "protect", "victims"),
    [
        ("10 20 30", None, (), []),  # no limit: keep everything
        ("10 20 30", 3, (), []),
        ("10 20 30 40", 2, (), [10, 20]),
        ("10 20 30", 1, (), [10, 20]),
        ("", 1, (), []),
        ("10i 20i", 1, (), []),  # nothing complete: nothing is removed
        # the newest complete one survives even when newer incomplete ones exist
        ("10 20 30i", 1, (), [10]),
        # incomplete older than the newest complete = abandoned write: removed
        ("10 15i 20 25i 30", 2, (), [10, 15, 25]),
        ("10 15i 20", 5, (), [15]),
        # protected checkpoints (the best one) are kept and count towards the limit (HF semantics)
        ("10 20 30 40 50 60", 5, ("checkpoint-10",), [20]),
        ("10 20 30", 1, ("checkpoint-10",), [20]),
        ("10 20 30", 1, ("/some/where/checkpoint-20/",), [10]),
        ("10 20 30", 2, ("checkpoint-30",), [10]),
        ("10i 20 30", 1, ("checkpoint-10",), [20]),  # a protected incomplete one is not touched
        # ordering is by step, not by name
        ("9 10 100", 2, (), [9]),
    ],
)
def test_rotation_victims_table(
    spec: str, limit: int | None, protect: tuple, victims: list[int]
) -> None:
    result = rotation_victims(_ckpts(spec), limit, frozenset(protect))
    assert [v.step for v in result] == victims


@pytest.mark.parametrize(
    ("spec", "attempt", "victims"),
    [
        # a newer incomplete directory of this attempt may still be being written: kept
        ("10 20 30i@3", 3, [10]),
        # one of an older attempt cannot be (a failed or killed save): removed
        ("10 20 30i@2", 3, [10, 30]),
        ("10 20 30i@2 40i@3", 3, [10, 30]),
        # unknown attempts (no operator, or a stock sentinel): kept, as before
        ("10 20 30i", 3, [10]),
        ("10 20 30i@2", None, [10]),
        # marked corrupt by a resume: nobody writes it, removed whatever its step
        ("10 20 30c", None, [10, 30]),
        ("10 20 30c@3", 3, [10, 30]),
        # still nothing removed without a complete checkpoint
        ("10i@1 20c", 3, []),
    ],
)
def test_rotation_removes_newer_directories_no_live_writer_can_be_writing(
    spec: str, attempt: int | None, victims: list[int]
) -> None:
    result = rotation_victims(_ckpts(spec), 1, frozenset(), attempt)
    assert [v.step for v in result] == victims


def test_rotation_never_removes_the_newest_complete() -> None:
    for n in range(1, 8):
        for limit in range(1, 5):
            ckpts = _ckpts(" ".join(f"{s}{'i' if s % 3 == 0 else ''}" for s in range(1, n + 1)))
            newest = max((c for c in ckpts if c.complete), key=lambda c: c.step, default=None)
            victims = rotation_victims(ckpts, limit)
            if newest is not None:
                assert newest not in victims
            assert len([c for c in ckpts if c.complete and c not in victims]) <= max(limit, 1)


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_rotation_rejects_bad_limit(limit: object) -> None:
    with pytest.raises(ConfigurationError, match="save_total_limit"):
        rotation_victims(_ckpts("1 2"), limit)  # type: ignore[arg-type]


def _save(out: str, step: int, attempt: int | None = 1) -> None:
    w = CheckpointWriter(out, step, attempt=attempt)
    w.begin()
    w.write_tensors("model.safetensors", {"w": torch.full((4,), float(step))})
    w.write_json("trainer_state.json", {"global_step": step})
    w.commit()


def test_rotate_checkpoints_on_disk(tmp_path: Path) -> None:
    out = str(tmp_path)
    for step in (10, 20, 30):
        _save(out, step)
    abandoned = CheckpointWriter(out, 25, attempt=1)
    abandoned.begin()  # never committed
    in_progress = CheckpointWriter(out, 40, attempt=1)
    in_progress.begin()
    removed = rotate_checkpoints(out, 2, protect=[f"{out}/checkpoint-10"])
    assert removed == [f"{out}/checkpoint-20", f"{out}/checkpoint-25"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-10",
        "checkpoint-30",
        "checkpoint-40",
    ]
    store = CheckpointStore(out)
    assert store.inspect("checkpoint-30").complete and store.inspect("checkpoint-10").complete
    assert (tmp_path / "checkpoint-40" / SENTINEL_NAME).exists()  # newer write is left alone
    assert rotate_checkpoints(out, None) == []


def test_rotate_checkpoints_memory_url() -> None:
    out = "memory://engA-rotation/run"
    try:
        for step in (1, 2, 3):
            _save(out, step)
        assert rotate_checkpoints(out, 1) == [f"{out}/checkpoint-1", f"{out}/checkpoint-2"]
        assert [c.step for c in CheckpointStore(out).list()] == [3]
    finally:
        CheckpointStore(out).storage.rm_tree("")


def test_stale_attempt_does_not_rotate(tmp_path: Path) -> None:
    out = str(tmp_path)
    _save(out, 10, attempt=1)
    _save(out, 20, attempt=1)
    _save(out, 30, attempt=2)
    with pytest.raises(CheckpointError, match="attempt 2"):
        rotate_checkpoints(out, 1, attempt=1)
    assert [c.step for c in CheckpointStore(out).list()] == [10, 20, 30]
    assert rotate_checkpoints(out, 1, attempt=2) == [f"{out}/checkpoint-10", f"{out}/checkpoint-20"]


class _SentinelFirstFS(MemoryFileSystem):
    """An in-memory store whose recursive delete unlinks the sentinel first (a directory order
    that can happen on any filesystem) and whose process 'dies' after ``budget`` unlinks."""

    protocol = ("sentinelfirst",)
    store: dict = {}  # noqa: RUF012 - fsspec's own class-level store, one per protocol
    pseudo_dirs = [""]  # noqa: RUF012
    budget: int | None = None

    def _unlinked(self) -> None:
        if self.budget is not None:
            if self.budget == 0:
                raise _Crash()
            type(self).budget = self.budget - 1

    def rm_file(self, path: str) -> None:
        self._unlinked()
        super().rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):  # type: ignore[no-untyped-def]
        files = sorted(self.find(path), key=lambda p: not p.endswith(SENTINEL_NAME))
        for name in files:
            self.rm_file(name)
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


class _Crash(Exception):
    pass


def _stock_checkpoint(storage: Storage, step: int) -> None:
    """What transformers.Trainer writes (no manifest of ours)."""
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        storage.write_bytes(f"checkpoint-{step}/{name}", b"x" * 64)
    storage.write_json(f"checkpoint-{step}/trainer_state.json", {"global_step": step})


@pytest.mark.parametrize("kind", ["ours", "stock"])
def test_rotation_interrupted_at_any_unlink_never_leaves_a_complete_looking_victim(
    kind: str,
) -> None:
    register_implementation("sentinelfirst", _SentinelFirstFS, clobber=True)
    out = "sentinelfirst://rotation/run"
    storage = Storage(out)
    for budget in range(12):
        _SentinelFirstFS.budget = None
        _SentinelFirstFS.store.clear()
        for step in (1, 2):
            if kind == "ours":
                _save(out, step)
            else:
                _stock_checkpoint(storage, step)
        store = CheckpointStore(out)
        assert store.inspect("checkpoint-1").complete
        _SentinelFirstFS.budget = budget  # the process dies at this unlink
        with contextlib.suppress(CheckpointError):  # _Crash, as storage reports it
            rotate_checkpoints(out, 1)
        _SentinelFirstFS.budget = None
        left = store.inspect("checkpoint-1")
        assert not left.complete, f"{kind}, crash after {budget} unlinks: {left}"
        assert store.latest_complete().step == 2  # type: ignore[union-attr]
