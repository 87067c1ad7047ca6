"""The completeness rule (DESIGN.md), as a pure function and on real directories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer_runtime.checkpoint.layout import (
    CORRUPT_NAME,
    MANIFEST_NAME,
    SENTINEL_NAME,
    TRAINER_STATE_NAME,
    CheckpointStore,
    is_complete,
    mark_corrupt,
    parse_step,
)

MANIFEST = {
    "format": "preemptible-checkpoint/1",
    "step": 5,
    "files": [
        {"path": "model.safetensors", "size": 100, "sha256": "x"},
        {"path": "trainer_state.json", "size": 10, "sha256": "y"},
    ],
}
ALL = {"model.safetensors": 100, "trainer_state.json": 10, MANIFEST_NAME: 50}
# What transformers.Trainer._save_checkpoint writes for one process (no manifest of ours).
STOCK = {
    "config.json": 600,
    "model.safetensors": 1000,
    "optimizer.pt": 2000,
    "scheduler.pt": 1400,
    "rng_state.pth": 14000,
    "training_args.bin": 5000,
    TRAINER_STATE_NAME: 900,
}


@pytest.mark.parametrize(
    ("files", "manifest", "complete", "reason_part"),
    [
        (ALL, MANIFEST, True, None),
        ({**ALL, "extra.bin": 3}, MANIFEST, True, None),  # unlisted extra files do not matter
        ({**ALL, SENTINEL_NAME: 0}, MANIFEST, False, "sentinel"),
        ({"model.safetensors": 100, "trainer_state.json": 10}, None, True, None),  # stock HF
        (
            {"model.safetensors": 100, TRAINER_STATE_NAME: 10, SENTINEL_NAME: 0},
            None,
            False,
            "sentinel",
        ),
        ({"model.safetensors": 100}, None, False, f"{MANIFEST_NAME} missing"),
        ({}, None, False, f"{MANIFEST_NAME} missing"),
        ({**ALL}, None, False, "unreadable"),  # manifest.json present but could not be parsed
        (
            {"trainer_state.json": 10, MANIFEST_NAME: 50},
            MANIFEST,
            False,
            "file model.safetensors missing",
        ),
        (
            {**ALL, "model.safetensors": 99},
            MANIFEST,
            False,
            "file model.safetensors size 99 != 100",
        ),
        ({**ALL}, {"files": "nope"}, False, "malformed"),
        ({**ALL}, {"files": [{"size": 1}]}, False, "malformed"),
        # a resume found it corrupt: never complete again, whatever else is there
        ({**ALL, CORRUPT_NAME: 80}, MANIFEST, False, "marked corrupt"),
        ({**STOCK, CORRUPT_NAME: 80}, None, False, "marked corrupt"),
    ],
)
def test_is_complete_table(
    files: dict[str, int], manifest: dict | None, complete: bool, reason_part: str | None
) -> None:
    ok, reason = is_complete(files, manifest)
    assert ok is complete
    if reason_part is None:
        assert reason is None
    else:
        assert reason is not None and reason_part in reason


def _without(files: dict[str, int], *names: str) -> dict[str, int]:
    return {k: v for k, v in files.items() if k not in names}


@pytest.mark.parametrize(
    ("files", "complete", "reason_part"),
    [
        (STOCK, True, None),
        (
            _without(STOCK, "optimizer.pt", "scheduler.pt", "rng_state.pth"),
            True,
            None,
        ),  # model only
        ({**_without(STOCK, "model.safetensors"), "adapter_model.safetensors": 9}, True, None),
        # several ranks: one RNG file each
        (
            {**_without(STOCK, "rng_state.pth"), "rng_state_0.pth": 9, "rng_state_1.pth": 9},
            True,
            None,
        ),
        # sharded weights with their index
        (
            {
                **_without(STOCK, "model.safetensors"),
                "model.safetensors.index.json": 50,
                "model-00001-of-00002.safetensors": 500,
                "model-00002-of-00002.safetensors": 500,
            },
            True,
            None,
        ),
        # FSDP: the model and the optimizer in state directories of their own
        (
            {
                **_without(STOCK, "model.safetensors", "optimizer.pt"),
                "pytorch_model_fsdp_0/__0_0.distcp": 500,
                "optimizer_0/__0_0.distcp": 900,
            },
            True,
            None,
        ),
        # DeepSpeed: everything in global_step<N>/
        (
            {**_without(STOCK, "model.safetensors", "optimizer.pt"), "global_step5/a.pt": 5},
            True,
            None,
        ),
        (_without(STOCK, TRAINER_STATE_NAME), False, f"no {TRAINER_STATE_NAME}"),
        # half removed (a recursive delete unlinks in directory order) or cut short
        (_without(STOCK, "model.safetensors"), False, "no model weights"),
        (_without(STOCK, "scheduler.pt"), False, "scheduler.pt missing"),
        (_without(STOCK, "optimizer.pt"), False, "no optimizer state"),
        (
            {**_without(STOCK, "rng_state.pth"), "rng_state_0.pth": 9, "rng_state_2.pth": 9},
            False,
            "rng_state_1.pth missing",
        ),
        (
            {
                **_without(STOCK, "model.safetensors"),
                "model.safetensors.index.json": 50,
                "model-00002-of-00003.safetensors": 500,
            },
            False,
            "2 of 3 shards of model.safetensors missing (e.g. model-00001-of-00003",
        ),
        (
            {**_without(STOCK, "model.safetensors"), "model.safetensors.index.json": 50},
            False,
            "none of its shards",
        ),
        # written but never flushed: an empty file after a crash (no fsync)
        ({**STOCK, TRAINER_STATE_NAME: 0}, False, f"file {TRAINER_STATE_NAME} is empty"),
        ({**STOCK, "model.safetensors": 0}, False, "file model.safetensors is empty"),
    ],
)
def test_stock_transformers_checkpoint_rule(
    files: dict[str, int], complete: bool, reason_part: str | None
) -> None:
    ok, reason = is_complete(files, None)
    assert ok is complete, reason
    if reason_part is not None:
        assert reason is not None and reason_part in reason


def test_every_problem_is_reported() -> None:
    ok, reason = is_complete({MANIFEST_NAME: 1, "model.safetensors": 1}, MANIFEST)
    assert not ok
    assert reason == (
        "file model.safetensors size 1 != 100 (listed in manifest.json); "
        "file trainer_state.json missing"
    )


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("checkpoint-0", 0),
        ("checkpoint-120", 120),
        ("/x/checkpoint-7/", 7),
        ("checkpoint-", None),
        ("checkpoint-1a", None),
        ("run-5", None),
        ("checkpoint--1", None),
    ],
)
def test_parse_step(name: str, step: int | None) -> None:
    assert parse_step(name) == step


def _write_ckpt(
    root: Path,
    step: int,
    *,
    sentinel: bool = False,
    manifest: bool = True,
    truncate: str | None = None,
    drop: str | None = None,
) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    files = {"model.safetensors": b"m" * 64, "trainer_state.json": b'{"global_step": %d}' % step}
    for name, data in files.items():
        (d / name).write_bytes(data)
    if manifest:
        listed = [{"path": n, "size": len(b), "sha256": "0"} for n, b in files.items()]
        (d / MANIFEST_NAME).write_text(
            json.dumps(
                {"format": "preemptible-checkpoint/1", "step": step, "attempt": 2, "files": listed}
            )
        )
    if sentinel:
        (d / SENTINEL_NAME).write_text(json.dumps({"attempt": 3}))
    if truncate:
        (d / truncate).write_bytes(b"m" * 10)
    if drop:
        (d / drop).unlink()
    return d


def test_store_inspect_explains_why(tmp_path: Path) -> None:
    _write_ckpt(tmp_path, 1)
    _write_ckpt(tmp_path, 2, sentinel=True)
    _write_ckpt(tmp_path, 3, truncate="model.safetensors")
    _write_ckpt(tmp_path, 4, drop="trainer_state.json")
    _write_ckpt(tmp_path, 5, manifest=False)  # stock Hugging Face checkpoint
    _write_ckpt(tmp_path, 6, manifest=False, drop="trainer_state.json")
    (tmp_path / "checkpoint-7").write_text("a file, not a checkpoint dir")
    (tmp_path / "runs").mkdir()
    store = CheckpointStore(str(tmp_path))
    infos = store.list()
    assert [i.step for i in infos] == [1, 2, 3, 4, 5, 6]
    by_step = {i.step: i for i in infos}
    assert by_step[1].complete and by_step[1].reason is None and by_step[1].attempt == 2
    assert not by_step[2].complete and "sentinel" in (by_step[2].reason or "")
    assert by_step[2].attempt == 2  # the manifest wins over the sentinel
    assert by_step[3].reason == "file model.safetensors size 10 != 64 (listed in manifest.json)"
    assert by_step[4].reason == "file trainer_state.json missing"
    assert by_step[5].complete and by_step[5].manifest is None and by_step[5].attempt is None
    assert not by_step[6].complete and "manifest.json missing" in (by_step[6].reason or "")
    assert by_step[1].size_bytes == sum(
        f.stat().st_size for f in (tmp_path / "checkpoint-1").iterdir()
    )
    assert store.latest_complete() is not None and store.latest_complete().step == 5  # type: ignore[union-attr]
    assert [i.step for i in store.incomplete()] == [2, 3, 4, 6]
    # inspect by name, by step, by path and by file:// URL agree
    for key in (
        "checkpoint-3",
        "3",
        str(tmp_path / "checkpoint-3"),
        f"file://{tmp_path}/checkpoint-3",
    ):
        assert store.inspect(key).reason == by_step[3].reason


def test_sentinel_attempt_is_reported_for_incomplete_writes(tmp_path: Path) -> None:
    _write_ckpt(tmp_path, 9, sentinel=True, manifest=False)
    info = CheckpointStore(str(tmp_path)).inspect("checkpoint-9")
    assert not info.complete and info.attempt == 3


def test_marked_corrupt_checkpoint_is_never_complete(tmp_path: Path) -> None:
    _write_ckpt(tmp_path, 1)
    _write_ckpt(tmp_path, 2)
    store = CheckpointStore(str(tmp_path))
    assert store.latest_complete().step == 2  # type: ignore[union-attr]
    marker = mark_corrupt(store.storage, "checkpoint-2", "model.safetensors: xxh3 a != b", 4)
    assert marker == f"{tmp_path}/checkpoint-2/{CORRUPT_NAME}"
    assert json.loads(Path(marker).read_text())["attempt"] == 4
    info = store.inspect("checkpoint-2")
    assert not info.complete and info.corrupt
    assert info.reason == (
        f"marked corrupt by a resume ({CORRUPT_NAME}): model.safetensors: xxh3 a != b"
    )
    assert info.attempt == 2  # still the writer's (the manifest's)
    assert store.latest_complete().step == 1  # type: ignore[union-attr]
    assert store.latest_complete(below=1) is None
    assert [i.name for i in store.list_from_listing() if i.corrupt] == ["checkpoint-2"]


def test_missing_output_dir_lists_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "nope"))
    assert store.list() == [] and store.latest_complete() is None
    assert store.inspect("checkpoint-1").reason == "directory does not exist"
