"""Which checkpoint a resume loads (resume_choice.resolve_in_store), over real directories: a
path from the operator is the least it may resume from (issue 37: told checkpoint-80 while
checkpoint-120 was complete, the runtime trained 40 steps twice and replaced checkpoint-120);
the caller's own path is honoured as given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.layout import CORRUPT_NAME, SENTINEL_NAME
from trainer_runtime.checkpoint.resume_choice import resolve_in_store
from trainer_runtime.errors import ResumeError


def _checkpoint(out: Path, step: int) -> None:
    w = CheckpointWriter(str(out), step, attempt=1)
    w.begin()
    w.write_tensors("model.safetensors", {"w": torch.full((4,), float(step))})
    w.write_json("trainer_state.json", {"global_step": step})
    w.commit()


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """checkpoint-4, -8 and -12 complete; checkpoint-16 incomplete (a save cut short)."""
    root = tmp_path / "out"
    for step in (4, 8, 12):
        _checkpoint(root, step)
    (root / "checkpoint-16").mkdir()
    (root / "checkpoint-16" / SENTINEL_NAME).write_text("{}")
    return root


@pytest.mark.parametrize(
    ("asked", "from_env", "loaded"),
    [
        # the operator's path: the newest complete checkpoint next to it, when newer
        ("checkpoint-4", True, 12),
        ("checkpoint-8", True, 12),
        ("checkpoint-12", True, 12),
        # the caller's own path: as given
        ("checkpoint-4", False, 4),
        ("checkpoint-8", False, 8),
        # latest
        (True, True, 12),
        (True, False, 12),
    ],
)
def test_resolve(out: Path, asked: str | bool, from_env: bool, loaded: int) -> None:
    resume = asked if isinstance(asked, bool) else str(out / asked)
    info = resolve_in_store(str(out), resume, from_env=from_env)
    assert info is not None and info.complete and info.step == loaded, info


@pytest.mark.parametrize("from_env", [True, False])
@pytest.mark.parametrize("asked", ["checkpoint-16", "checkpoint-40"])
def test_an_unusable_path_with_nothing_newer_is_an_error(
    out: Path, asked: str, from_env: bool
) -> None:
    # incomplete or missing, and no complete checkpoint is newer: not silently an older one
    with pytest.raises(ResumeError, match=asked):
        resolve_in_store(str(out), str(out / asked), from_env=from_env)


def test_a_corrupt_newest_checkpoint_gives_way_to_the_one_before(out: Path) -> None:
    (out / "checkpoint-12" / CORRUPT_NAME).write_text("{}")
    info = resolve_in_store(str(out), str(out / "checkpoint-4"), from_env=True)
    assert info is not None and info.step == 8, info
    info = resolve_in_store(str(out), str(out / "checkpoint-12"), from_env=True)
    assert info is not None and info.step == 8, info
