"""The checksum of each file in the manifest: new checkpoints list ``xxh3_128``; checkpoints
that list ``sha256`` (written by earlier versions) are still verified, with sha256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import xxhash

from trainer_runtime.checkpoint.digest import ALGORITHMS, listed_digest, new_hasher
from trainer_runtime.checkpoint.io import CheckpointReader, CheckpointWriter
from trainer_runtime.errors import CheckpointError, ResumeError

FILES = ("model.safetensors", "optimizer.safetensors", "trainer_state.json")


def _checkpoint(root: Path) -> Path:
    w = CheckpointWriter(str(root), 7, attempt=1)
    w.begin()
    w.write_tensors("model.safetensors", {"w": torch.randn(64, 32)}, {"format": "pt"})
    w.write_tensors("optimizer.safetensors", {"m": torch.randn(1 << 16), "v": torch.ones(5)})
    w.write_json("trainer_state.json", {"global_step": 7})
    return Path(w.commit().path)


def _as_written_before(path: Path) -> None:
    """Rewrite the manifest the way earlier versions listed files: a sha256 per file."""
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        del entry["xxh3_128"]
        entry["sha256"] = hashlib.sha256((path / entry["path"]).read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def _flip_last_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-2] ^= 0xFF  # a tensor byte (or inside the JSON text): the header still parses
    path.write_bytes(bytes(raw))


def _load(reader: CheckpointReader, filename: str, how: str) -> None:
    if how == "bytes":
        reader.load_bytes(filename)
    else:
        reader.load_tensors_and_metadata(filename, owned=how == "owned")
    reader.wait_verified()


def test_new_manifests_list_the_xxh3_128_of_each_file_and_nothing_else(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(e["path"] for e in manifest["files"]) == sorted(FILES)
    for entry in manifest["files"]:
        data = (path / entry["path"]).read_bytes()
        assert entry == {
            "path": entry["path"],
            "size": len(data),
            "xxh3_128": xxhash.xxh3_128(data).hexdigest(),
        }


@pytest.mark.parametrize(
    ("filename", "how"),
    [
        ("trainer_state.json", "bytes"),
        ("model.safetensors", "mapped"),
        ("optimizer.safetensors", "owned"),
    ],
)
@pytest.mark.parametrize("written_before", [False, True], ids=["xxh3_128", "sha256"])
def test_each_listed_checksum_is_verified_with_its_own_algorithm(
    tmp_path: Path, filename: str, how: str, written_before: bool
) -> None:
    path = _checkpoint(tmp_path)
    if written_before:
        _as_written_before(path)
    _load(CheckpointReader(str(path)), filename, how)  # intact: loads
    _flip_last_byte(path / filename)
    algorithm = "sha256" if written_before else "xxh3_128"
    with pytest.raises(ResumeError, match=f"{filename} .* is corrupt: {algorithm} "):
        _load(CheckpointReader(str(path)), filename, how)
    # verify=False is the caller's explicit choice: the same bytes load unchecked
    _load(CheckpointReader(str(path), verify=False), filename, how)


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"path": "a", "size": 1, "xxh3_128": "ab"}, ("xxh3_128", "ab")),
        ({"path": "a", "size": 1, "sha256": "cd"}, ("sha256", "cd")),
        ({"path": "a", "size": 1, "sha256": "cd", "xxh3_128": "ab"}, ("xxh3_128", "ab")),
        ({"path": "a", "size": 1}, None),
        ({"path": "a", "size": 1, "xxh3_128": ""}, None),
    ],
)
def test_listed_digest_prefers_the_current_algorithm(
    entry: dict[str, object], expected: tuple[str, str] | None
) -> None:
    assert listed_digest(entry) == expected


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_hasher_gives_its_algorithms_digest(algorithm: str) -> None:
    data = bytes(range(256)) * 100
    hasher = new_hasher(algorithm)
    hasher.update(memoryview(data)[:1000])
    hasher.update(memoryview(data)[1000:])
    reference = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}[algorithm]
    assert hasher.hexdigest() == reference(data).hexdigest()


def test_an_unknown_algorithm_is_refused_by_name() -> None:
    with pytest.raises(CheckpointError, match=r"'md4'.*known: xxh3_128, sha256"):
        new_hasher("md4")
