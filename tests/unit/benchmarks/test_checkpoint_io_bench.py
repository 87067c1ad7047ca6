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


@pytest.mark.parametrize(
    ("direct_read", "runs"),
    [
        ("both", [["hf", "ours", "ours_pc"], ["ours_pc", "ours", "hf"]]),
        ("off", [["hf", "ours_pc"], ["ours_pc", "hf"]]),
        ("on", [["hf", "ours"], ["ours", "hf"]]),
    ],
)
def test_direct_read_ab_alternates_ours_with_the_page_cache_read(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    direct_read: str,
    runs: list[list[str]],
) -> None:
    """--direct-read: ours once with the default (O_DIRECT) read of a cold optimizer file, once
    with PREEMPTIBLE_DIRECT_READ=0 in the child (``page_cache_read``), both orders."""
    trained: list[str] = []

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        who = spec["impl"] + ("_pc" if spec.get("page_cache_read") else "")
        if spec["mode"] == "train":
            trained.append(who)
            return {"bytes": 1000, "save_s": 1.0, "stall_s": 1.0, "steps_per_s": 1.0,
                    "peak_rss": 1}  # fmt: skip
        return {"resume_s": 0.5 if who == "ours" else 1.0, "peak_rss": 1, "cold_start_s": 1.0}

    monkeypatch.setattr(bench, "_run", run)
    monkeypatch.setattr(bench, "_raw_write", lambda spec: {"raw_s": 1.0, "raw_mb_s": 1.0})
    monkeypatch.setattr(bench, "_drop_cache", lambda path: "fadvise")
    bench._bench(4, 2, tmp_path, 1, False, io_only=True, direct_read=direct_read)
    assert [trained[: len(runs[0])], trained[len(runs[0]) :]] == runs
    out = capsys.readouterr().out
    assert ("O_DIRECT / ours page cache:" in out) is (direct_read == "both")
    if direct_read == "both":
        assert "0.50x" in out  # ours 0.5 s against 1.0 s read through the page cache


def test_the_child_turns_direct_reads_off_for_the_page_cache_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PREEMPTIBLE_DIRECT_READ", "1")  # the parent's own: never inherited
    seen: dict[str, str | None] = {}

    class Stop(Exception):
        pass

    def stop(*a: Any, **kw: Any) -> None:
        seen["env"] = os.environ.get("PREEMPTIBLE_DIRECT_READ")
        raise Stop

    import trainer_runtime

    monkeypatch.setattr(trainer_runtime, "TrainingArguments", stop)
    for flag, want in ((True, "0"), (False, None)):
        with pytest.raises(Stop):
            bench._child({"mode": "resume", "impl": "ours", "width": 4, "output_dir": "x",
                          "tunings": False, "page_cache_read": flag})  # fmt: skip
        assert seen["env"] == want
