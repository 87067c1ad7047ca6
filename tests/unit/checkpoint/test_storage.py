"""Storage: one API over local paths, file:// and memory://, with errors that name URL and cause."""

from __future__ import annotations

import errno
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import xxhash

from tests.unit.checkpoint import _enospc_fs
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import CheckpointError, StorageError


@pytest.fixture(params=["path", "file", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "path":
        yield Storage(str(tmp_path / "out"))
    elif request.param == "file":
        yield Storage(f"file://{tmp_path}/out")
    else:
        url = f"memory://engA-storage-{uuid.uuid4().hex}/out"
        s = Storage(url)
        yield s
        if s.exists(""):
            s.rm_tree("")


def test_round_trip(storage: Storage) -> None:
    storage.makedirs("a/b")
    size, sha = storage.write_bytes("a/b/data.bin", b"hello world")
    assert (size, sha) == (11, xxhash.xxh3_128(b"hello world").hexdigest())
    storage.write_json("a/x.json", {"k": [1, 2]})
    storage.atomic_write_json("a/y.json", {"v": 1})
    storage.atomic_write_json("a/y.json", {"v": 2})  # replaces
    assert storage.read_bytes("a/b/data.bin") == b"hello world"
    assert storage.read_json("a/x.json") == {"k": [1, 2]}
    assert storage.read_json("a/y.json") == {"v": 2}
    assert storage.exists("a/b/data.bin") and not storage.exists("a/nope")
    listing = storage.listdir("a")
    assert set(listing) == {"x.json", "y.json"}  # no leftover temp file, no directories
    assert storage.subdirs("a") == ["b"]
    assert storage.walk_files("a") == {
        "b/data.bin": 11,
        "x.json": listing["x.json"],
        "y.json": listing["y.json"],
    }
    storage.fsync_dir("a")
    storage.remove("a/x.json")
    assert not storage.exists("a/x.json")
    storage.rm_tree("a")
    assert not storage.exists("a")


def test_open_write_hashes_while_writing(storage: Storage) -> None:
    with storage.open_write("f.bin") as fh:
        for chunk in (b"ab", b"cd", b"e" * 1000):
            fh.write(chunk)
    assert fh.size == 1004
    assert fh.digest == xxhash.xxh3_128(b"abcd" + b"e" * 1000).hexdigest()
    assert storage.read_bytes("f.bin") == b"abcd" + b"e" * 1000


def test_join_keeps_the_users_url_style(tmp_path: Path) -> None:
    assert Storage(str(tmp_path)).join("checkpoint-1", "model.safetensors") == (
        f"{tmp_path}/checkpoint-1/model.safetensors"
    )
    assert (
        Storage("memory://bucket/run/").join("checkpoint-1") == "memory://bucket/run/checkpoint-1"
    )
    assert Storage("memory://bucket/run").join() == "memory://bucket/run"


def test_read_missing_is_storage_error_with_url(tmp_path: Path) -> None:
    s = Storage(str(tmp_path))
    with pytest.raises(StorageError) as info:
        s.read_bytes("missing.bin")
    err = info.value
    assert err.not_found and err.operation == "read" and err.url == f"{tmp_path}/missing.bin"
    assert isinstance(err, CheckpointError)


def test_not_a_directory_is_storage_error(tmp_path: Path) -> None:
    # root is not stopped by file modes, so use a real obstacle: a regular file in the path
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file")
    s = Storage(str(blocker / "out"))
    with pytest.raises(StorageError) as info:
        s.makedirs("checkpoint-1")
    err = info.value
    assert err.errno in (errno.ENOTDIR, errno.EEXIST)
    assert err.url == f"{blocker}/out/checkpoint-1" and err.operation == "create directory"
    assert str(blocker) in str(err)
    with pytest.raises(StorageError) as info2:
        s.write_bytes("x.bin", b"1")
    assert info2.value.operation == "open for writing"


def _chattr(flag: str, path: Path) -> bool:
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0


def test_immutable_directory_is_storage_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    if not _chattr("+i", out):
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE and ext4/xfs)")
    try:
        s = Storage(str(out))
        with pytest.raises(StorageError) as info:
            s.write_bytes("new.bin", b"data")
        assert info.value.errno in (errno.EPERM, errno.EACCES, errno.EROFS)
        with pytest.raises(StorageError) as info2:
            s.atomic_write_json("m.json", {"a": 1})
        assert info2.value.url == f"{out}/m.json"
        assert (out / "keep.txt").read_text() == "old"
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # no temp files left
    finally:
        _chattr("-i", out)


def test_full_disk_is_storage_error_naming_the_cause() -> None:
    _enospc_fs.register()
    _enospc_fs.reset()
    s = Storage("fulldisk://vol/out", {"capacity": 100})
    s.write_bytes("small.bin", b"x" * 60)
    with pytest.raises(StorageError) as info:
        s.write_bytes("big.bin", b"y" * 60)
    err = info.value
    assert err.errno == errno.ENOSPC and err.operation == "write"
    assert err.url == "fulldisk://vol/out/big.bin"
    assert "No space left on device" in str(err) and "free space" in str(err)
    assert s.read_bytes("small.bin") == b"x" * 60


def test_unknown_protocol_is_storage_error() -> None:
    with pytest.raises(StorageError, match="open filesystem"):
        Storage("nosuchprotocol-xyz://bucket/out")
