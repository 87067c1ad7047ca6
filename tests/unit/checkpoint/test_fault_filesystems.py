"""The fault-injecting filesystems and event helpers of trainer_runtime.testing."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer_runtime import testing
from trainer_runtime.checkpoint.layout import SENTINEL_NAME
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import StorageError


@pytest.fixture(autouse=True)
def _fresh_faults() -> Iterator[None]:
    testing.register_test_filesystems()
    yield
    testing.configure_faults()


def test_sentinel_name_matches_the_checkpoint_module() -> None:
    assert testing._SENTINEL_NAME == SENTINEL_NAME


@pytest.mark.parametrize(
    ("path", "step"),
    [
        ("/out/checkpoint-8/checkpoint-is-incomplete.txt", 8),
        ("/out/checkpoint-0", 0),
        ("s3://bucket/run/checkpoint-120/model.safetensors", 120),
        ("/out/checkpoint-final/x", None),
        ("/out/model.safetensors", None),
    ],
)
def test_checkpoint_step(path: str, step: int | None) -> None:
    assert testing.checkpoint_step(path) == step


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"save_sleep": -1.0}, "save_sleep=-1.0"), ({"enospc_after_bytes": -5}, "-5")],
)
def test_configure_faults_rejects_bad_values(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        testing.configure_faults(**kwargs)


def test_slow_filesystem_delays_each_file_and_reports_the_save(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    testing.configure_faults(save_sleep=0.2, events_file=str(events))
    store = Storage(f"slowfile://{tmp_path}/out")
    assert not store.is_local, "must not take the plain-open() path that bypasses the fault"
    store.makedirs("checkpoint-4")
    started = time.monotonic()
    store.write_bytes(f"checkpoint-4/{SENTINEL_NAME}", b"{}")
    store.write_bytes("checkpoint-4/model.safetensors", b"x" * 1000)
    assert time.monotonic() - started >= 0.4
    store.remove(f"checkpoint-4/{SENTINEL_NAME}")
    assert (tmp_path / "out/checkpoint-4/model.safetensors").read_bytes() == b"x" * 1000
    assert store.listdir("checkpoint-4") == {"model.safetensors": 1000}
    names = [(e["event"], e["step"]) for e in testing.read_events(events)]
    assert names == [("save_begin", 4), ("save_committed", 4)]


def test_full_disk_fails_after_the_budget_and_keeps_earlier_files(tmp_path: Path) -> None:
    testing.configure_faults(enospc_after_bytes=150)
    store = Storage(f"fulldiskfile://{tmp_path}/out")
    store.makedirs("checkpoint-4")
    store.write_bytes("checkpoint-4/a", b"a" * 100)
    with pytest.raises(StorageError) as caught:
        store.write_bytes("checkpoint-4/b", b"b" * 100)
    assert "checkpoint-4/b" in str(caught.value)
    cause = caught.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert (tmp_path / "out/checkpoint-4/a").read_bytes() == b"a" * 100
    assert (tmp_path / "out/checkpoint-4/b").stat().st_size == 50  # truncated, like a full disk
    assert testing.fault_config().bytes_written == 150


def test_read_events_ignores_a_partial_last_line(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    testing.append_event(events, "step_begin", step=1)
    with open(events, "a", encoding="utf-8") as fh:
        fh.write('{"event": "step_e')
    assert [e["event"] for e in testing.read_events(events)] == ["step_begin"]
    assert testing.read_events(tmp_path / "missing.jsonl") == []


def test_access_check_creates_a_missing_directory_on_a_filesystem_with_directories(
    tmp_path: Path,
) -> None:
    # a run's first start on a non-local filesystem that has directories: the output dir does
    # not exist yet and must not fail the pre-training check (a local run creates it too)
    store = Storage(f"slowfile://{tmp_path}/new/out")
    store.check_access(write=True)
    assert (tmp_path / "new/out").is_dir()
    assert list((tmp_path / "new/out").iterdir()) == [], "the probe file is removed"
