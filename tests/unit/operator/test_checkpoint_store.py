"""The operator's storage view: path map and the completeness rule over real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preemptible_operator.checkpoint_store import CheckpointView, PathMap, parse_path_map


@pytest.mark.parametrize(
    ("entries", "pod_uri", "expected"),
    [
        ([], "/ckpt/run", None),
        (["/ckpt=/mnt/ckpt"], "/ckpt/run", "/mnt/ckpt/run"),
        (["/ckpt=/mnt/ckpt"], "/ckpt", "/mnt/ckpt"),
        (["/ckpt=/mnt/ckpt"], "/ckpts/run", None),  # prefix must end at a path boundary
        (["/ckpt=/a", "/ckpt/run=/b"], "/ckpt/run/x", "/b/x"),  # longest prefix wins
        (["s3://bucket=s3://bucket"], "s3://bucket/job", "s3://bucket/job"),
        (["/data/=/data/"], "/data/job", "/data/job"),
    ],
)
def test_path_map(entries: list[str], pod_uri: str, expected: str | None) -> None:
    assert parse_path_map(entries).to_operator(pod_uri) == expected


def test_parse_path_map_rejects_bad_entries() -> None:
    with pytest.raises(ValueError, match="POD_PREFIX=OPERATOR_PREFIX"):
        parse_path_map(["/ckpt"])


def _checkpoint(root: Path, step: int, *, complete: bool, truncate: bool = False) -> None:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x" * 10)
    if not complete:
        (d / "checkpoint-is-incomplete.txt").write_text("{}")
        return
    manifest = {
        "format": "preemptible-checkpoint/1",
        "step": step,
        "world_size": 1,
        "attempt": 1,
        "save_seconds": 0.5,
        "created_at": "2026-01-01T00:00:00Z",
        "files": [{"path": "model.safetensors", "size": 10, "sha256": "0"}],
    }
    (d / "manifest.json").write_text(json.dumps(manifest))
    if truncate:
        (d / "model.safetensors").write_bytes(b"x" * 3)


def test_snapshot_reports_latest_complete_and_incomplete(tmp_path: Path) -> None:
    host = tmp_path / "host"
    _checkpoint(host, 5, complete=True)
    _checkpoint(host, 10, complete=True, truncate=True)
    _checkpoint(host, 15, complete=False)
    view = CheckpointView("/ckpt/run", PathMap(((("/ckpt/run"), str(host)),)))
    snap = view.snapshot()
    assert snap is not None and snap.latest_complete is not None
    assert snap.latest_complete.step == 5
    assert snap.latest_complete_path == "/ckpt/run/checkpoint-5"  # as the pods see it
    assert snap.latest_complete.save_seconds == 0.5
    incomplete = {info.step: (path, info.reason) for info, path in snap.incomplete}
    assert set(incomplete) == {10, 15}
    assert incomplete[15][0] == "/ckpt/run/checkpoint-15"
    assert "size" in (incomplete[10][1] or "") and "sentinel" in (incomplete[15][1] or "")


def test_unreadable_without_mapping_and_empty_root(tmp_path: Path) -> None:
    assert CheckpointView("/elsewhere", PathMap()).snapshot() is None
    view = CheckpointView("/c", PathMap((("/c", str(tmp_path / "missing")),)))
    snap = view.snapshot()
    assert snap is not None and snap.latest_complete is None and snap.incomplete == ()
