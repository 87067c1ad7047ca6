"""benchmarks/checkpoint_io.py (issue 38.5): how the page cache is dropped before a cold resume
(drop_caches where writable, else fadvise on the checkpoint's files, and which was used), and
the raw O_DIRECT reference write of exactly the bytes asked for."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any

import pytest

from tests.unit.benchmark_modules import load_benchmark

bench = load_benchmark("checkpoint_io.py")


def _checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "checkpoint-3"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"m" * 10000)
    (ckpt / "sub" / "x.json").write_text("{}")
    return ckpt


def test_without_drop_caches_every_file_is_fsynced_then_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _checkpoint(tmp_path)
    real_open = builtins.open

    def no_proc(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/proc/sys/vm/drop_caches":
            raise PermissionError(13, "not root")
        return real_open(path, *args, **kwargs)

    calls: list[tuple[str, int]] = []
    fds: dict[int, str] = {}
    real_os_open = os.open

    def spy_open(path: Any, flags: int, *args: Any) -> int:
        fd = real_os_open(path, flags, *args)
        fds[fd] = Path(path).name
        return fd

    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(bench.os, "open", spy_open)
    monkeypatch.setattr(bench.os, "fsync", lambda fd: calls.append((fds[fd], -1)))
    monkeypatch.setattr(
        bench.os, "posix_fadvise", lambda fd, off, n, advice: calls.append((fds[fd], advice))
    )
    assert bench._drop_cache(ckpt) == "fadvise"
    dontneed = os.POSIX_FADV_DONTNEED
    assert calls == [
        ("model.safetensors", -1),
        ("model.safetensors", dontneed),
        ("x.json", -1),
        ("x.json", dontneed),
    ]


def test_drop_caches_is_used_where_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[str] = []
    real_open = builtins.open

    class Sink:
        def __enter__(self) -> Sink:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def write(self, text: str) -> None:
            written.append(text)

    def proc(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path) == "/proc/sys/vm/drop_caches":
            return Sink()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", proc)
    monkeypatch.setattr(bench.os, "posix_fadvise", lambda *a: pytest.fail("fadvise used"))
    assert bench._drop_cache(_checkpoint(tmp_path)) == "drop_caches"
    assert written == ["1\n"]


@pytest.mark.parametrize("size", [4096 * 3, 4096 * 5 + 100])
def test_raw_write_writes_the_aligned_bytes_and_times_both_modes(tmp_path: Path, size: int) -> None:
    r = bench._raw_write({"bytes": size, "output_dir": str(tmp_path), "rep": 0})
    assert r["raw_s"] == min(r[f"raw_{m}_s"] for m in ("buffered", "direct") if f"raw_{m}_s" in r)
    assert "raw_buffered_mb_s" in r
    assert not (tmp_path / "raw.bin").exists()
