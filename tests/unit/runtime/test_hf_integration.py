"""Unit tests of the transformers.Trainer integration (trainer_runtime.hf): resume resolution,
the commit of a directory written by transformers, attaching, and the CLI on such checkpoints."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the integration needs transformers (dev extra)")

from trainer_runtime import cli
from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.checkpoint.layout import (
    MANIFEST_NAME,
    RUNTIME_STATE_NAME,
    SENTINEL_NAME,
    CheckpointStore,
)
from trainer_runtime.errors import CheckpointCorruptError, ConfigurationError, ResumeError
from trainer_runtime.hf import PreemptibleCallback, attach, install, resolve_resume, uninstall
from trainer_runtime.hf.callback import scratch_dir, upload_owners


def _hf_files(d: Path, step: int) -> None:
    """What transformers' _save_checkpoint leaves (names and shapes only; content is opaque)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " * 10)
    (d / "optimizer.pt").write_bytes(os.urandom(300))
    (d / "rng_state.pth").write_bytes(os.urandom(50))
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def _committed(out: Path, step: int, record: dict | None = None) -> None:
    """A checkpoint committed the way the integration commits transformers' files."""
    w = CheckpointWriter(str(out), step, attempt=1)
    w.begin()
    _hf_files(out / f"checkpoint-{step}", step)
    if record is not None:
        w.write_json(RUNTIME_STATE_NAME, record)
    w.sync_present()
    adopted = w.adopt_present()
    assert "model.safetensors" in adopted and RUNTIME_STATE_NAME not in adopted
    w.commit({"producer": "transformers.Trainer"})


def _half_written(out: Path, step: int) -> None:
    """transformers' own JIT save killed mid-way: sentinel still there, truncated weights, but
    trainer_state.json already written (the measured failure that crashes a stock resume)."""
    d = out / f"checkpoint-{step}"
    _hf_files(d, step)
    (d / "model.safetensors").write_bytes(b"\x08\x00")
    (d / SENTINEL_NAME).write_text("Checkpoint started at step 8 and in progress...")


def test_adopted_files_are_listed_with_sizes_and_checksums(tmp_path: Path) -> None:
    _committed(tmp_path, 4)
    info = CheckpointStore(str(tmp_path)).inspect("checkpoint-4")
    assert info.complete, info
    listed = {f["path"]: f for f in info.manifest["files"]}
    assert set(listed) == {
        "model.safetensors",
        "optimizer.pt",
        "rng_state.pth",
        "trainer_state.json",
    }
    assert listed["optimizer.pt"]["size"] == 300 and len(listed["optimizer.pt"]["xxh3_128"]) == 32
    assert not (tmp_path / "checkpoint-4" / SENTINEL_NAME).exists()
    # the same completeness rule as for our own checkpoints: a size change breaks it
    (tmp_path / "checkpoint-4" / "optimizer.pt").write_bytes(b"short")
    again = CheckpointStore(str(tmp_path)).inspect("checkpoint-4")
    assert not again.complete and "optimizer.pt" in (again.reason or "")


@pytest.mark.parametrize(
    ("rank", "world", "jit", "files", "checksum"),
    [
        # a JIT save: the coordinator records everything, sizes only; nobody reads a byte back
        (0, 1, True, {"model.safetensors": 60, "optimizer.pt": 300, "rng.pth": 5}, False),
        (0, 2, True, {"model.safetensors": 60, "optimizer.pt": 300, "rng.pth": 5}, False),
        (1, 2, True, {}, False),
        # a periodic save: each file hashed by one rank, the bytes shared
        (0, 1, False, {"model.safetensors": 60, "optimizer.pt": 300, "rng.pth": 5}, True),
        (0, 2, False, {"optimizer.pt": 300}, True),
        (1, 2, False, {"model.safetensors": 60, "rng.pth": 5}, True),
        (2, 3, False, {"rng.pth": 5}, True),
    ],
)
def test_adoption_table(
    rank: int, world: int, jit: bool, files: dict[str, int], checksum: bool
) -> None:
    from trainer_runtime.hf.callback import adoption

    listing = {"model.safetensors": 60, "optimizer.pt": 300, "rng.pth": 5}
    assert adoption(listing, rank, world, jit=jit) == (files, checksum)


def test_a_jit_checkpoint_adopted_by_size_only_is_complete_and_resumable(tmp_path: Path) -> None:
    from trainer_runtime.checkpoint.io import CheckpointReader

    w = CheckpointWriter(str(tmp_path), 6, attempt=1)
    w.begin()
    _hf_files(tmp_path / "checkpoint-6", 6)
    w.sync_present()
    assert w.adopt(w.present_files(), checksum=False) == [
        "model.safetensors",
        "optimizer.pt",
        "rng_state.pth",
        "trainer_state.json",
    ]
    w.commit({"producer": "transformers.Trainer"})
    info = CheckpointStore(str(tmp_path)).inspect("checkpoint-6")
    assert info.complete, info
    assert {f["path"]: sorted(f) for f in info.manifest["files"]}["optimizer.pt"] == [
        "path",
        "size",
    ]
    reader = CheckpointReader(str(tmp_path / "checkpoint-6"))
    assert reader.has("optimizer.pt") and len(reader.load_bytes("optimizer.pt")) == 300
    # the size is still checked: a torn file makes the checkpoint incomplete
    (tmp_path / "checkpoint-6" / "optimizer.pt").write_bytes(b"torn")
    assert not CheckpointStore(str(tmp_path)).inspect("checkpoint-6").complete


def test_adopt_requires_begin(tmp_path: Path) -> None:
    w = CheckpointWriter(str(tmp_path), 1)
    with pytest.raises(Exception, match="begin"):
        w.adopt_present()


def test_resume_true_and_latest_skip_a_half_written_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _committed(tmp_path, 4)
    _half_written(tmp_path, 8)
    newest_complete = str(tmp_path / "checkpoint-4")
    assert resolve_resume(True, str(tmp_path)) == newest_complete
    monkeypatch.setenv("PREEMPTIBLE_RESUME_FROM", "latest")
    assert resolve_resume(None, str(tmp_path)) == newest_complete
    assert resolve_resume(False, str(tmp_path)) is False
    with pytest.raises(ResumeError, match="sentinel"):
        resolve_resume(str(tmp_path / "checkpoint-8"), str(tmp_path))
    monkeypatch.setenv("PREEMPTIBLE_RESUME_FROM", str(tmp_path / "checkpoint-8"))
    with pytest.raises(ResumeError):
        resolve_resume(None, str(tmp_path))


def test_resume_without_complete_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _half_written(tmp_path, 8)
    monkeypatch.setenv("PREEMPTIBLE_RESUME_FROM", "latest")
    assert resolve_resume(None, str(tmp_path)) is None  # a fresh start, not the broken one
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        resolve_resume(True, str(tmp_path))
    monkeypatch.delenv("PREEMPTIBLE_RESUME_FROM")
    assert resolve_resume(None, str(tmp_path)) is None


def test_inspect_and_grace_read_integration_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = {
        "producer": "transformers.Trainer",
        "step_seconds": {"max": 2.0, "count": 4},
        "save_seconds": {"max": 3.0, "count": 1},
        "sigterm_to_exit_seconds": [6.5],
    }
    _committed(tmp_path, 4, record)
    _half_written(tmp_path, 8)
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["latest_complete"].endswith("checkpoint-4")
    by_name = {c["name"]: c for c in doc["checkpoints"]}
    assert by_name["checkpoint-4"]["complete"] and not by_name["checkpoint-8"]["complete"]
    assert cli.main(["grace", str(tmp_path), "--json"]) == 0
    grace = json.loads(capsys.readouterr().out)
    assert grace["inputs"]["step_max"] == 2.0 and grace["inputs"]["sigterm_to_exit_seconds"] == [
        6.5
    ]
    assert grace["terminationGracePeriodSeconds"] >= 6


# -- attaching to a real transformers.Trainer ----------------------------------------------
def _trainer(tmp_path: Path, **kw: object):
    from transformers import Trainer, TrainingArguments

    from tests.transformers import models

    tok = models.tokenizer()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, max_steps=1, **kw
    )
    return Trainer(model=models.gpt2(tok), args=args)


def test_attach_replaces_transformers_jit_callback_and_restores_its_handler(
    tmp_path: Path,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    trainer = _trainer(tmp_path, enable_jit_checkpoint=True)
    assert signal.getsignal(signal.SIGTERM) is not before  # transformers installed its handler
    cb = attach(trainer)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert "JITCheckpointCallback" not in names and "PreemptibleCallback" in names
    assert signal.getsignal(signal.SIGTERM) is before
    assert attach(trainer) is cb  # idempotent
    assert names.count("PreemptibleCallback") == 1


def test_output_dir_from_the_operator_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREEMPTIBLE_OUTPUT_DIR", str(tmp_path / "pvc"))
    trainer = _trainer(tmp_path)
    attach(trainer)
    assert trainer.args.output_dir == str(tmp_path / "pvc")
    # An object store: transformers writes into a scratch directory, the callback uploads.
    monkeypatch.setenv("PREEMPTIBLE_OUTPUT_DIR", "s3://bucket/run")
    monkeypatch.setenv("PREEMPTIBLE_SCRATCH_DIR", str(tmp_path / "scratch"))
    trainer = _trainer(tmp_path)
    callback = attach(trainer)
    assert callback.remote == "s3://bucket/run"
    assert trainer.args.output_dir == scratch_dir("s3://bucket/run", str(tmp_path / "scratch"))
    assert Path(trainer.args.output_dir).is_dir()


@pytest.mark.parametrize(
    ("remote", "base", "expected_tail"),
    [
        ("s3://bucket/runs/a", "/scratch", "a-"),
        ("s3://bucket/runs/a/", "/scratch", "a-"),  # the same directory
        ("gs://bucket", "/scratch", "bucket-"),
    ],
)
def test_scratch_dir(remote: str, base: str, expected_tail: str) -> None:
    path = scratch_dir(remote, base)
    assert path.startswith("/scratch/preemptible-scratch/" + expected_tail)
    assert scratch_dir(remote.rstrip("/"), base) == path
    assert scratch_dir("s3://other/runs/a", base) != path  # two URLs never share one


@pytest.mark.parametrize(
    ("listings", "owners"),
    [
        ([("n0", ["model.safetensors", "rng_state.pth"])], {"model.safetensors": 0,
                                                           "rng_state.pth": 0}),
        # two nodes, one process each: each uploads what its node wrote
        ([("n0", ["model.safetensors", "rng_state_0.pth"]), ("n1", ["rng_state_1.pth"])],
         {"model.safetensors": 0, "rng_state_0.pth": 0, "rng_state_1.pth": 1}),
        # two processes share a node's scratch directory: its lowest rank uploads, once
        ([("n0", ["a", "r0", "r1"]), ("n0", ["a", "r0", "r1"]), ("n1", ["r2"])],
         {"a": 0, "r0": 0, "r1": 0, "r2": 2}),
    ],
)  # fmt: skip
def test_upload_owners(listings: list, owners: dict) -> None:
    assert upload_owners(listings) == owners


def test_callback_without_attach_says_how_to_attach() -> None:
    with pytest.raises(ConfigurationError, match="attach"):
        PreemptibleCallback().on_train_begin(None, None, None)


def test_install_attaches_to_every_trainer_subclass(tmp_path: Path) -> None:
    from transformers import Trainer

    class MyTrainer(Trainer):
        pass

    install()
    try:
        install()  # idempotent: one wrapper
        trainer = _trainer(tmp_path)
        from transformers import TrainingArguments

        from tests.transformers import models

        sub = MyTrainer(
            model=models.gpt2(models.tokenizer()),
            args=TrainingArguments(output_dir=str(tmp_path / "o2"), report_to="none", use_cpu=True),
        )
        for t in (trainer, sub):
            names = [type(c).__name__ for c in t.callback_handler.callbacks]
            assert names.count("PreemptibleCallback") == 1
    finally:
        uninstall()
    plain = _trainer(tmp_path)
    assert "PreemptibleCallback" not in [type(c).__name__ for c in plain.callback_handler.callbacks]


def test_manifest_name_is_ours(tmp_path: Path) -> None:
    _committed(tmp_path, 2)
    manifest = json.loads((tmp_path / "checkpoint-2" / MANIFEST_NAME).read_text())
    assert manifest["producer"] == "transformers.Trainer" and manifest["step"] == 2


def test_operator_reads_both_kinds_with_the_same_rule(tmp_path: Path) -> None:
    from preemptible_operator.checkpoint_store import CheckpointView, PathMap

    _committed(tmp_path, 4)  # transformers' files, our manifest
    _committed(tmp_path, 6)
    _half_written(tmp_path, 8)  # transformers' own JIT save, interrupted
    view = CheckpointView(str(tmp_path), PathMap(((str(tmp_path), str(tmp_path)),)))
    snap = view.snapshot()
    assert snap is not None and snap.latest_complete is not None
    assert snap.latest_complete.name == "checkpoint-6"
    assert [i.name for i, _ in snap.incomplete] == ["checkpoint-8"]
    # sizes must match the manifest: a file shortened after the commit makes it incomplete
    (tmp_path / "checkpoint-6" / "model.safetensors").write_bytes(b"\x00")
    snap = view.snapshot()
    assert snap is not None and snap.latest_complete is not None
    assert snap.latest_complete.name == "checkpoint-4"


class _FakeState:
    def __init__(self, step: int) -> None:
        self.global_step = step
        self.best_model_checkpoint = None
        self.max_steps = 100
        self.epoch = 0.0


class _FakeArgs:
    def __init__(self, out: Path, limit: int | None) -> None:
        self.output_dir = str(out)
        self.save_total_limit = limit


class _FakeTrainer:
    """Just what the committed save uses of a transformers.Trainer."""

    def __init__(self, out: Path, step: int, limit: int | None) -> None:
        self.args = _FakeArgs(out, limit)
        self.state = _FakeState(step)
        self.model = None

    def _get_output_dir(self, trial: object = None) -> str:
        return self.args.output_dir


def test_committed_save_rotates_only_after_the_commit(tmp_path: Path) -> None:
    _committed(tmp_path, 4)
    cb = PreemptibleCallback()
    cb.trainer = _FakeTrainer(tmp_path, 8, limit=1)
    seen: dict[str, object] = {}

    def transformers_save(model: object, trial: object) -> None:
        # inside transformers' save: its own rotation is off, the old checkpoint is still there,
        # and the new directory reads as incomplete (our sentinel went first)
        seen["limit"] = cb.trainer.args.save_total_limit
        seen["old"] = (tmp_path / "checkpoint-4").exists()
        seen["sentinel"] = (tmp_path / "checkpoint-8" / SENTINEL_NAME).exists()
        _hf_files(tmp_path / "checkpoint-8", 8)

    cb.committed_save(transformers_save, None, None)
    assert seen == {"limit": None, "old": True, "sentinel": True}
    assert cb.trainer.args.save_total_limit == 1  # restored
    store = CheckpointStore(str(tmp_path))
    assert [i.name for i in store.list()] == ["checkpoint-8"]  # rotated after the commit
    info = store.inspect("checkpoint-8")
    assert info.complete and cb.last_checkpoint is not None and cb.last_checkpoint.step == 8
    record = json.loads((tmp_path / "checkpoint-8" / RUNTIME_STATE_NAME).read_text())
    assert record["producer"] == "transformers.Trainer" and "step_seconds" in record
    assert cb.save_timer.count == 1
    # a second save request for the same step (an epoch save after a JIT one) is a no-op
    cb.committed_save(lambda *a: pytest.fail("saved twice"), None, None)


def test_committed_save_failure_removes_its_partial_checkpoint(tmp_path: Path) -> None:
    _committed(tmp_path, 1)
    cb = PreemptibleCallback()
    cb.trainer = _FakeTrainer(tmp_path, 3, limit=None)

    def failing_save(model: object, trial: object) -> None:
        (tmp_path / "checkpoint-3").mkdir(exist_ok=True)
        (tmp_path / "checkpoint-3" / "model.safetensors").write_bytes(b"\x01\x02")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        cb.committed_save(failing_save, None, None)
    # its partial directory does not keep holding the space; the previous one is untouched
    assert not (tmp_path / "checkpoint-3").exists()
    assert CheckpointStore(str(tmp_path)).latest_complete().step == 1  # type: ignore[union-attr]


def test_a_save_of_the_step_resumed_from_keeps_the_complete_checkpoint(tmp_path: Path) -> None:
    # Re-saving the step just resumed from would delete its complete checkpoint before the
    # new one is complete: it is the same state, so the save is skipped.
    _committed(tmp_path, 4)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-4").iterdir()}
    cb = PreemptibleCallback()
    cb.trainer = _FakeTrainer(tmp_path, 4, limit=None)
    assert cb._resolve(True) == str(tmp_path / "checkpoint-4")
    assert cb.last_checkpoint is not None and cb.last_checkpoint.step == 4
    cb.committed_save(lambda *a: pytest.fail("checkpoint-4 rewritten"), None, None)
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-4").iterdir()}
    assert after == before and CheckpointStore(str(tmp_path)).inspect("checkpoint-4").complete


def _remote_checkpoint(url: str, step: int) -> None:
    w = CheckpointWriter(url, step, attempt=1)
    w.begin()
    w.write_bytes("model.safetensors", os.urandom(256))
    w.write_json("trainer_state.json", {"global_step": step})
    w.commit({"producer": "transformers.Trainer"})


def test_a_corrupt_download_is_marked_and_the_previous_checkpoint_downloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = "memory://eng31-hf-fallback/run"
    store = CheckpointStore(remote)
    try:
        for step in (2, 4):
            _remote_checkpoint(remote, step)
        blob = bytearray(store.storage.read_bytes("checkpoint-4/model.safetensors"))
        blob[-1] ^= 0xFF  # same size: only the checksum, checked as it arrives, tells
        store.storage.write_bytes("checkpoint-4/model.safetensors", bytes(blob))
        cb = PreemptibleCallback()
        cb.trainer = _FakeTrainer(tmp_path / "scratch", 4, limit=None)
        cb.remote = remote
        with pytest.raises(CheckpointCorruptError, match="asked for by path"):
            cb._resolve(f"{remote}/checkpoint-4")
        assert store.inspect("checkpoint-4").corrupt
        monkeypatch.setenv("PREEMPTIBLE_RESUME_FROM", f"{remote}/checkpoint-4")  # the operator's
        local = cb._resolve(None)
        assert local == str(tmp_path / "scratch" / "checkpoint-2")
        assert (Path(local) / "model.safetensors").stat().st_size == 256
        assert cb.last_checkpoint is not None and cb.last_checkpoint.step == 2
    finally:
        store.storage.rm_tree("")


def test_a_corrupt_download_falls_back_under_latest(tmp_path: Path) -> None:
    remote = "memory://eng31-hf-fallback-latest/run"
    store = CheckpointStore(remote)
    try:
        for step in (2, 4):
            _remote_checkpoint(remote, step)
        blob = bytearray(store.storage.read_bytes("checkpoint-4/model.safetensors"))
        blob[0] ^= 0xFF
        store.storage.write_bytes("checkpoint-4/model.safetensors", bytes(blob))
        cb = PreemptibleCallback()
        cb.trainer = _FakeTrainer(tmp_path / "scratch", 4, limit=None)
        cb.remote = remote
        assert cb._resolve(True) == str(tmp_path / "scratch" / "checkpoint-2")
        info = store.inspect("checkpoint-4")
        assert not info.complete and "model.safetensors" in (info.reason or "")
        assert not (tmp_path / "scratch" / "checkpoint-4").exists()  # the bad copy is gone
    finally:
        store.storage.rm_tree("")
