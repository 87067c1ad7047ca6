"""Unit tests of the transformers.Trainer integration (trainer_runtime.hf): resume resolution,
the commit of a directory written by transformers, attaching, and the CLI on such checkpoints."""

from __future__ import annotations

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
from trainer_runtime.errors import ConfigurationError, ResumeError
from trainer_runtime.hf import PreemptibleCallback, attach, install, resolve_resume, uninstall


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
    assert listed["optimizer.pt"]["size"] == 300 and len(listed["optimizer.pt"]["sha256"]) == 64
    assert not (tmp_path / "checkpoint-4" / SENTINEL_NAME).exists()
    # the same completeness rule as for our own checkpoints: a size change breaks it
    (tmp_path / "checkpoint-4" / "optimizer.pt").write_bytes(b"short")
    again = CheckpointStore(str(tmp_path)).inspect("checkpoint-4")
    assert not again.complete and "optimizer.pt" in (again.reason or "")


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
    monkeypatch.setenv("PREEMPTIBLE_OUTPUT_DIR", "s3://bucket/run")
    with pytest.raises(ConfigurationError, match="local or mounted"):
        attach(_trainer(tmp_path))


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
