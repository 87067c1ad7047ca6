"""Writing and reading checkpoints: commit protocol, multi-rank merge, fencing, failures."""

from __future__ import annotations

import copy
import datetime as dt
import errno
import json
import shutil
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from safetensors.torch import save as st_save

from tests.unit.checkpoint import _enospc_fs
from trainer_runtime.checkpoint.io import (
    CheckpointReader,
    CheckpointWriter,
    optimizer_state_from_tensors,
    optimizer_state_to_tensors,
)
from trainer_runtime.checkpoint.layout import (
    CORRUPT_NAME,
    MANIFEST_NAME,
    SENTINEL_NAME,
    CheckpointStore,
    mark_corrupt,
)
from trainer_runtime.errors import CheckpointError, ConfigurationError, ResumeError, StorageError
from trainer_runtime.protocol import ENV_ATTEMPT


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _save(
    output_dir: str,
    step: int,
    *,
    attempt: int | None = 1,
    payload: int = 64,
    storage_options: dict | None = None,
) -> Any:
    w = CheckpointWriter(output_dir, step, attempt=attempt, storage_options=storage_options)
    w.begin()
    w.write_tensors("model.safetensors", {"w": torch.arange(payload, dtype=torch.float32)})
    w.write_json("trainer_state.json", {"global_step": step})
    return w.commit()


@pytest.fixture(params=["local", "memory"])
def out(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "out")
    return f"memory://engA-io-{uuid.uuid4().hex}/out"


def test_commit_writes_manifest_and_removes_sentinel(out: str) -> None:
    w = CheckpointWriter(out, 7, attempt=4)
    w.begin()
    store = CheckpointStore(out)
    during = store.inspect("checkpoint-7")
    assert not during.complete and "sentinel" in (during.reason or "") and during.attempt == 4
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(4), "scalar": torch.tensor(2.5)}
    w.write_tensors("model.safetensors", tensors, metadata={"format": "pt"})
    w.write_json("trainer_state.json", {"global_step": 7})
    w.write_bytes("sub/extra.bin", b"\x00\x01")
    assert not store.storage.exists(f"checkpoint-7/{MANIFEST_NAME}")  # not before commit
    info = w.commit(extra_manifest={"model_class": "Toy"})
    assert info.complete and info.step == 7 and info.attempt == 4
    assert not store.storage.exists(f"checkpoint-7/{SENTINEL_NAME}")
    m = store.storage.read_json(f"checkpoint-7/{MANIFEST_NAME}")
    assert m["format"] == "preemptible-checkpoint/1" and m["step"] == 7 and m["world_size"] == 1
    assert m["attempt"] == 4 and m["model_class"] == "Toy" and m["save_seconds"] > 0
    assert dt.datetime.fromisoformat(m["created_at"].replace("Z", "+00:00")).tzinfo is not None
    assert [f["path"] for f in m["files"]] == [
        "model.safetensors",
        "sub/extra.bin",
        "trainer_state.json",
    ]
    for f in m["files"]:
        data = store.storage.read_bytes(f"checkpoint-7/{f['path']}")
        assert f["size"] == len(data) and f["xxh3_128"] == xxhash.xxh3_128(data).hexdigest()

    r = CheckpointReader(info.path)
    loaded = r.load_tensors("model.safetensors")
    assert set(loaded) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(loaded[k], t) and loaded[k].dtype == t.dtype
    assert r.load_metadata("model.safetensors") == {"format": "pt"}
    assert r.load_json("trainer_state.json") == {"global_step": 7}
    assert r.load_bytes("sub/extra.bin") == b"\x00\x01" and r.step == 7


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    ],
    ids=["adamw", "sgd-nesterov", "sgd-momentum"],
)
def test_optimizer_state_round_trip_is_exact(
    make_opt: Callable[[Any], torch.optim.Optimizer], tmp_path: Path
) -> None:
    model = _model()
    opt = make_opt(model.parameters())
    _train(model, opt, 5, seed=1)
    w = CheckpointWriter(str(tmp_path), 5, attempt=None)
    w.begin()
    w.write_tensors("model.safetensors", model.state_dict())
    w.write_optimizer_state("optimizer.safetensors", opt.state_dict())
    w.commit()

    # pure helpers: exact structure, types (int param ids, tuple betas) and bits
    tensors, meta = optimizer_state_to_tensors(opt.state_dict())
    rebuilt = optimizer_state_from_tensors(tensors, meta)
    _assert_same_state(rebuilt, opt.state_dict())

    # resume into fresh objects from the files, continue both, compare bit for bit
    r = CheckpointReader(str(tmp_path / "checkpoint-5"))
    model2 = _model(seed=99)
    model2.load_state_dict(r.load_tensors("model.safetensors"))
    opt2 = make_opt(model2.parameters())
    loaded = r.load_optimizer_state("optimizer.safetensors")
    _assert_same_state(loaded, opt.state_dict())
    opt2.load_state_dict(loaded)
    _train(model, opt, 3, seed=2)
    _train(model2, opt2, 3, seed=2)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def _assert_same_state(a: Any, b: Any) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same_state(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same_state(x, y)
    else:
        assert a == b


def test_optimizer_state_rejects_unstorable_values() -> None:
    with pytest.raises(CheckpointError, match="param_groups"):
        optimizer_state_to_tensors({"state": {}, "param_groups": [{"fn": object()}]})


def test_interrupted_save_is_incomplete_and_refused_on_resume(out: str) -> None:
    _save(out, 10)
    w = CheckpointWriter(out, 20, attempt=1)
    w.begin()
    w.write_tensors("model.safetensors", {"w": torch.zeros(10)})
    # the process dies here: no commit
    store = CheckpointStore(out)
    assert [(c.step, c.complete) for c in store.list()] == [(10, True), (20, False)]
    assert store.latest_complete().step == 10  # type: ignore[union-attr]
    with pytest.raises(ResumeError) as info:
        CheckpointReader(f"{out}/checkpoint-20")
    assert f"{out}/checkpoint-20" in str(info.value) and SENTINEL_NAME in str(info.value)
    # the next attempt rewrites the same step: leftovers of the dead writer are dropped first
    info2 = _save(out, 20, attempt=2)
    assert info2.complete and info2.attempt == 2
    assert sorted(store.storage.walk_files("checkpoint-20")) == [
        MANIFEST_NAME,
        "model.safetensors",
        "trainer_state.json",
    ]


def test_corrupt_file_is_detected_by_checksum(tmp_path: Path) -> None:
    info = _save(str(tmp_path), 3)
    f = tmp_path / "checkpoint-3" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # same size, so the completeness rule still passes
    f.write_bytes(bytes(data))
    r = CheckpointReader(info.path)
    with pytest.raises(ResumeError, match="xxh3_128"):
        r.load_tensors("model.safetensors")
    assert (
        CheckpointReader(info.path, verify=False).load_tensors("model.safetensors")["w"].numel()
        == 64
    )


def test_reader_accepts_stock_hugging_face_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "checkpoint-500"
    d.mkdir()
    (d / "model.safetensors").write_bytes(st_save({"x": torch.ones(2)}))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": 500}))
    r = CheckpointReader(str(d))
    assert (
        r.info.complete
        and r.step == 500
        and torch.equal(r.load_tensors("model.safetensors")["x"], torch.ones(2))
    )


def _run_ranks(world_size: int, body: Callable[[int, Callable[[], None]], Any]) -> list[Any]:
    barrier = threading.Barrier(world_size, timeout=60)
    results: list[Any] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank, barrier.wait)
        except BaseException as exc:
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def test_multi_rank_merge(out: str) -> None:
    def body(rank: int, barrier: Callable[[], None]) -> Any:
        w = CheckpointWriter(out, 30, rank=rank, world_size=3, attempt=1, barrier=barrier)
        w.begin()
        w.write_tensors(
            f"model-rank{rank}.safetensors", {"p": torch.full((rank + 1,), float(rank))}
        )
        if rank == 0:
            w.write_json("trainer_state.json", {"global_step": 30})
        return w.commit()

    results = _run_ranks(3, body)
    for r in results:
        assert not isinstance(r, BaseException), r
        assert r.complete and r.step == 30
    m = results[0].manifest
    assert m["world_size"] == 3
    assert [f["path"] for f in m["files"]] == [
        "model-rank0.safetensors",
        "model-rank1.safetensors",
        "model-rank2.safetensors",
        "trainer_state.json",
    ]
    for entry in m["files"]:  # each rank's checksum survives the merge
        data = CheckpointStore(out).storage.read_bytes(f"checkpoint-30/{entry['path']}")
        assert entry["xxh3_128"] == xxhash.xxh3_128(data).hexdigest(), entry["path"]
    files = CheckpointStore(out).storage.walk_files("checkpoint-30")
    assert not [f for f in files if f.startswith(".partial-rank-")]  # records merged and removed
    reader = CheckpointReader(f"{out}/checkpoint-30")
    assert torch.equal(reader.load_tensors("model-rank2.safetensors")["p"], torch.full((3,), 2.0))


def test_multi_rank_duplicate_file_fails_on_every_rank(out: str) -> None:
    def body(rank: int, barrier: Callable[[], None]) -> Any:
        w = CheckpointWriter(out, 40, rank=rank, world_size=2, attempt=1, barrier=barrier)
        w.begin()
        # both ranks write the same name: the second overwrote the first, so it cannot commit
        w.write_bytes("model.safetensors", b"x" * (rank + 1))
        return w.commit()

    results = _run_ranks(2, body)
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert "model.safetensors" in str(results[0])
    assert not CheckpointStore(out).inspect("checkpoint-40").complete


def test_multi_rank_coordinator_failure_does_not_hang_others(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = str(blocker / "out")  # makedirs fails with ENOTDIR on the coordinator

    def body(rank: int, barrier: Callable[[], None]) -> Any:
        w = CheckpointWriter(out, 1, rank=rank, world_size=2, attempt=1, barrier=barrier)
        w.begin()
        return w

    results = _run_ranks(2, body)
    assert isinstance(results[0], StorageError)
    assert isinstance(results[1], CheckpointError) and "coordinator" in str(results[1])


def test_attempt_fencing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = str(tmp_path)
    _save(out, 10, attempt=3)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-10").iterdir()}
    # a stale writer (attempt 2) can neither overwrite step 10 nor add a new checkpoint
    for step in (10, 15):
        with pytest.raises(CheckpointError, match="attempt 3") as info:
            CheckpointWriter(out, step, attempt=2).begin()
        assert "stale attempt" in str(info.value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-10").iterdir()} == before
    assert not (tmp_path / "checkpoint-15").exists()
    # the attempt defaults to $PREEMPTIBLE_ATTEMPT
    monkeypatch.setenv(ENV_ATTEMPT, "2")
    with pytest.raises(CheckpointError):
        CheckpointWriter(out, 20).begin()
    monkeypatch.setenv(ENV_ATTEMPT, "4")
    info4 = _save(out, 10, attempt=None)
    assert info4.complete and info4.attempt == 4
    monkeypatch.setenv(ENV_ATTEMPT, "four")
    with pytest.raises(ConfigurationError, match=ENV_ATTEMPT):
        CheckpointWriter(out, 30)


def test_newer_attempt_in_progress_is_not_overwritten(tmp_path: Path) -> None:
    out = str(tmp_path)
    newer = CheckpointWriter(out, 50, attempt=5)
    newer.begin()
    newer.write_bytes("model.safetensors", b"new")
    with pytest.raises(CheckpointError, match="attempt 5"):
        CheckpointWriter(out, 50, attempt=4).begin()
    assert (tmp_path / "checkpoint-50" / "model.safetensors").read_bytes() == b"new"
    assert newer.commit().complete


def test_takeover_during_save_is_detected(tmp_path: Path) -> None:
    out = str(tmp_path)
    first = CheckpointWriter(out, 60, attempt=1)
    first.begin()
    second = CheckpointWriter(out, 60, attempt=1)  # same attempt, e.g. a duplicate process
    second.begin()
    first.write_bytes("a.bin", b"1")
    with pytest.raises(CheckpointError, match="taken over"):
        first.commit()


def test_full_disk_leaves_previous_checkpoint_complete() -> None:
    _enospc_fs.register()
    _enospc_fs.reset()
    out = "fulldisk://vol/run"
    _save(out, 1, storage_options={"capacity": 10**9})
    with pytest.raises(StorageError) as info:
        _save(out, 2, payload=4096, storage_options={"capacity": 2000})
    err = info.value
    assert err.errno == errno.ENOSPC and err.url == f"{out}/checkpoint-2/model.safetensors"
    assert err.operation == "write"
    store = CheckpointStore(out)
    assert store.inspect("checkpoint-1").complete
    two = store.inspect("checkpoint-2")
    assert not two.complete and "sentinel" in (two.reason or "")
    assert store.latest_complete().step == 1  # type: ignore[union-attr]
    CheckpointReader(f"{out}/checkpoint-1").load_tensors("model.safetensors")


def test_unwritable_checkpoint_path_leaves_previous_complete(tmp_path: Path) -> None:
    out = str(tmp_path)
    _save(out, 1)
    (tmp_path / "checkpoint-2").write_text("a regular file where the dir must go")
    with pytest.raises(StorageError) as info:
        _save(out, 2)
    assert info.value.url == f"{out}/checkpoint-2" and info.value.operation == "create directory"
    assert CheckpointStore(out).latest_complete().step == 1  # type: ignore[union-attr]


def test_immutable_output_dir_leaves_previous_complete(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _save(str(out), 1)
    if (
        shutil.which("chattr") is None
        or subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode
    ):
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE and ext4/xfs)")
    try:
        with pytest.raises(StorageError) as info:
            _save(str(out), 2)
        assert info.value.errno in (errno.EPERM, errno.EACCES, errno.EROFS)
        assert CheckpointStore(str(out)).latest_complete().step == 1  # type: ignore[union-attr]
        assert [p.name for p in out.iterdir()] == ["checkpoint-1"]
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=False)


def test_file_size_limit_mid_write_on_local_disk(tmp_path: Path) -> None:
    """A real kernel write failure (RLIMIT_FSIZE -> EFBIG) half-way through a local save."""
    out = str(tmp_path / "out")
    _save(out, 1)
    script = textwrap.dedent(
        f"""
        import json, resource, signal, torch
        from trainer_runtime.checkpoint.io import CheckpointWriter
        from trainer_runtime.errors import StorageError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        w = CheckpointWriter({out!r}, 2, attempt=1)
        w.begin()
        try:
            w.write_tensors("model.safetensors", {{"w": torch.zeros(200_000)}})
        except StorageError as e:
            print(json.dumps({{"errno": e.errno, "url": e.url, "op": e.operation}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {
        "errno": errno.EFBIG,
        "url": f"{out}/checkpoint-2/model.safetensors",
        "op": "write",
    }
    store = CheckpointStore(out)
    assert store.latest_complete().step == 1  # type: ignore[union-attr]
    assert not store.inspect("checkpoint-2").complete


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/abs.bin",
        "../x.bin",
        "a/../b",
        MANIFEST_NAME,
        SENTINEL_NAME,
        ".partial-rank-00001.json",
    ],
)
def test_bad_filenames_are_rejected(tmp_path: Path, name: str) -> None:
    w = CheckpointWriter(str(tmp_path), 1)
    w.begin()
    with pytest.raises(ConfigurationError, match="filename"):
        w.write_bytes(name, b"x")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"step": -1}, "step"),
        ({"world_size": 0}, "world_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"world_size": 2}, "barrier"),
    ],
)
def test_bad_writer_arguments(tmp_path: Path, kwargs: dict, field: str) -> None:
    args = {"step": 1, **kwargs}
    step = args.pop("step")
    with pytest.raises(ConfigurationError, match=field):
        CheckpointWriter(str(tmp_path), step, **args)


def test_protocol_misuse(tmp_path: Path) -> None:
    w = CheckpointWriter(str(tmp_path), 1)
    with pytest.raises(CheckpointError, match="begin"):
        w.write_bytes("a.bin", b"1")
    w.begin()
    with pytest.raises(ConfigurationError, match="reserved"):
        w.commit(extra_manifest={"files": []})
    w.write_bytes("a.bin", b"1")
    with pytest.raises(CheckpointError, match="twice"):
        w.write_bytes("a.bin", b"2")
    assert w.commit().complete
    with pytest.raises(CheckpointError, match="committed"):
        w.write_bytes("b.bin", b"1")
    assert copy.copy(w.files) == w.files


def test_a_rewrite_of_a_marked_checkpoint_keeps_the_marker_until_its_commit(out: str) -> None:
    _save(out, 3)
    store = CheckpointStore(out)
    mark_corrupt(store.storage, "checkpoint-3", "model.safetensors: xxh3 a != b")
    w = CheckpointWriter(out, 3, attempt=2)
    w.begin()
    w.write_tensors("model.safetensors", {"w": torch.ones(4)})
    # cut short here, it still reads as the corrupt checkpoint (what a resume falls back from)
    during = store.inspect("checkpoint-3")
    assert not during.complete and during.corrupt
    w.write_json("trainer_state.json", {"global_step": 3})
    info = w.commit()
    assert info.complete and not info.corrupt
    assert CORRUPT_NAME not in store.storage.walk_files("checkpoint-3")
    assert CORRUPT_NAME not in {f["path"] for f in info.manifest["files"]}  # type: ignore[index]


def test_the_corrupt_marker_is_not_a_checkpoint_file(tmp_path: Path) -> None:
    w = CheckpointWriter(str(tmp_path), 1)
    w.begin()
    with pytest.raises(ConfigurationError, match=CORRUPT_NAME):
        w.write_bytes(CORRUPT_NAME, b"{}")
