"""A save that fails (a full disk) removes its own partial directory instead of leaving it to
hold the space; the previous complete checkpoint stays (issue 31, item 7)."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.errors import StorageError
from trainer_runtime.protocol import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_RESUME_FROM
from trainer_runtime.testing import configure_faults, register_test_filesystems

from .test_resume import make_trainer


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def full_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A ``fulldiskfile://`` output dir with room for one checkpoint and a half."""
    register_test_filesystems()
    probe = tmp_path / "probe"
    make_trainer(probe, max_steps=2, save_steps=2).train()
    size = CheckpointStore(str(probe)).latest_complete().size_bytes  # type: ignore[union-attr]
    configure_faults(enospc_after_bytes=int(size * 1.5))
    yield tmp_path / "out"
    configure_faults()


@pytest.mark.parametrize("save_async", [False, True], ids=["blocking", "background"])
def test_a_save_that_fills_the_disk_removes_its_partial_directory(
    full_disk: Path, caplog: pytest.LogCaptureFixture, save_async: bool
) -> None:
    trainer = make_trainer(
        f"fulldiskfile://{full_disk}", max_steps=8, save_steps=2, save_async=save_async
    )
    with caplog.at_level(logging.WARNING), pytest.raises(StorageError) as failed:
        trainer.train()
    assert failed.value.errno == errno.ENOSPC and "checkpoint-4" in failed.value.url
    assert "removed the partial checkpoint" in caplog.text and "checkpoint-4" in caplog.text
    assert not (full_disk / "checkpoint-4").exists()  # its space is back
    store = CheckpointStore(str(full_disk))
    assert [(c.name, c.complete) for c in store.list()] == [("checkpoint-2", True)]


def test_discard_never_removes_a_directory_whose_sentinel_is_not_its_own(
    tmp_path: Path,
) -> None:
    writer = CheckpointWriter(str(tmp_path), 3, attempt=1)
    writer.begin()
    writer.write_json("trainer_state.json", {"global_step": 3})
    # another writer took the directory over (its own sentinel): not ours to remove
    (tmp_path / "checkpoint-3" / SENTINEL_NAME).write_text('{"token": "theirs", "attempt": 2}')
    assert writer.discard() == []
    assert (tmp_path / "checkpoint-3" / "trainer_state.json").exists()


def test_discard_of_one_rank_among_several_removes_only_its_own_files(tmp_path: Path) -> None:
    # With other ranks possibly still writing into the directory, a failing rank removes the
    # files it started; the directory and its sentinel stay (rotation removes it later).
    out = tmp_path / "checkpoint-5"
    out.mkdir()
    (out / SENTINEL_NAME).write_text('{"token": "rank0"}')
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x" * 10)  # rank 0's
    writer = CheckpointWriter(str(tmp_path), 5, rank=1, world_size=2, barrier=lambda: None)
    writer._started = 0.0  # begun (the coordinator created the sentinel)
    writer.write_bytes("model-00002-of-00002.safetensors", b"y" * 10)
    removed = writer.discard()
    assert removed == [f"{tmp_path}/checkpoint-5/model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == [
        SENTINEL_NAME,
        "model-00001-of-00002.safetensors",
    ]
