"""Rotation (save_total_limit): decisions as a pure table, then on real directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer_runtime.checkpoint.io import CheckpointWriter, rotate_checkpoints
from trainer_runtime.checkpoint.layout import (
    SENTINEL_NAME,
    CheckpointInfo,
    CheckpointStore,
    rotation_victims,
)
from trainer_runtime.errors import CheckpointError, ConfigurationError


def _ckpts(spec: str) -> list[CheckpointInfo]:
    """'10 20 30i' -> checkpoints at steps 10, 20 (complete) and 30 (incomplete)."""
    out = []
    for token in spec.split():
        incomplete = token.endswith("i")
        step = int(token.rstrip("i"))
        out.append(
            CheckpointInfo(
                f"/o/checkpoint-{step}",
                f"checkpoint-{step}",
                step,
                not incomplete,
                "sentinel" if incomplete else None,
                1,
                None,
                None,
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
