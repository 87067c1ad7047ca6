"""`trainer-runtime inspect|grace`, run as a real subprocess on checkpoints written here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer_runtime.checkpoint.io import CheckpointWriter
from trainer_runtime.cli import human_size


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer_runtime.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _state(step: int, step_max: float | None, save_max: float | None, exits: list[float]) -> dict:
    return {
        "global_step": step,
        "preemptible": {
            "step_seconds": {
                "last": 1.0,
                "ema": 1.0,
                "p99": step_max,
                "max": step_max,
                "count": step,
            },
            "save_seconds": {"last": save_max, "max": save_max, "count": 1},
            "sigterm_to_exit_seconds": exits,
            "attempt": 2,
            "data_position": {"epoch": 0, "batch": step},
        },
    }


def _save(out: Path, step: int, state: dict | None, attempt: int = 2, commit: bool = True) -> None:
    w = CheckpointWriter(str(out), step, attempt=attempt)
    w.begin()
    w.write_tensors("model.safetensors", {"w": torch.zeros(2048)})
    if state is not None:
        w.write_json("trainer_state.json", state)
    if commit:
        w.commit()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    _save(out, 10, _state(10, 1.0, 0.5, []))
    _save(out, 20, _state(20, 120.0, 100.0, [30.0, 200.5]))
    _save(out, 30, _state(30, 1.0, 1.0, []), commit=False)  # interrupted save
    (out / "checkpoint-20" / "model.safetensors").rename(out / "checkpoint-20" / "gone")
    _save(out, 15, _state(15, 1.0, 1.0, []))
    return out


def test_inspect_table(run_dir: Path) -> None:
    proc = cli("inspect", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"output dir: {run_dir}"
    assert lines[1].split() == ["STEP", "CHECKPOINT", "SIZE", "ATTEMPT", "SAVE_S", "STATUS"]
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert list(rows) == ["10", "15", "20", "30"]
    size = human_size(sum(p.stat().st_size for p in (run_dir / "checkpoint-10").iterdir()))
    assert size.endswith("KiB")
    assert rows["10"].split()[2:5] == [*size.split(), "2"] and rows["10"].endswith("complete")
    assert "INCOMPLETE: file model.safetensors missing" in rows["20"]
    assert "INCOMPLETE: sentinel checkpoint-is-incomplete.txt present" in rows["30"]
    assert lines[-1] == "newest complete: checkpoint-15"


def test_inspect_json(run_dir: Path) -> None:
    proc = cli("inspect", f"file://{run_dir}", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["latest_complete"] == f"file://{run_dir}/checkpoint-15"
    by_step = {c["step"]: c for c in doc["checkpoints"]}
    assert (
        by_step[10]["complete"] and by_step[10]["attempt"] == 2 and by_step[10]["save_seconds"] > 0
    )
    assert by_step[10]["size_bytes"] == sum(
        p.stat().st_size for p in (run_dir / "checkpoint-10").iterdir()
    )
    assert by_step[20]["reason"] == "file model.safetensors missing"
    assert by_step[30]["complete"] is False and by_step[30]["save_seconds"] is None


def test_inspect_empty_and_missing(tmp_path: Path) -> None:
    proc = cli("inspect", str(tmp_path))
    assert proc.returncode == 0 and "no checkpoints" in proc.stdout
    proc = cli("inspect", str(tmp_path / "nope"))
    assert proc.returncode == 1 and "does not exist" in proc.stderr


def test_grace_from_newest_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _save(out, 10, _state(10, 120.0, 119.0, []))
    _save(out, 20, _state(20, 120.0, 120.0, []))
    proc = cli("grace", str(out), "--headroom", "0", "--exit-margin", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["terminationGracePeriodSeconds"] == 243  # the reference example
    assert doc["checkpoint"] == f"{out}/checkpoint-20" and doc["step"] == 20
    assert doc["inputs"]["step_max"] == 120.0 and doc["inputs"]["save_max"] == 120.0
    assert doc["inputs"]["kill_wait"] == 3.0
    proc = cli("grace", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "terminationGracePeriodSeconds: 308"  # defaults: 25 % + 5
    assert "step_max: 120.0" in proc.stdout and "headroom: 0.25" in proc.stdout


def test_grace_uses_observed_exit_times_and_clamps(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _save(out, 5, _state(5, 10.0, 10.0, [30.0, 200.5]))
    doc = json.loads(
        cli("grace", str(out), "--headroom", "0", "--exit-margin", "0", "--json").stdout
    )
    assert doc["terminationGracePeriodSeconds"] == 201 and "observed" in doc["reason"]
    assert doc["inputs"]["sigterm_to_exit_seconds"] == [30.0, 200.5]
    doc = json.loads(cli("grace", str(out), "--max", "100", "--json").stdout)
    assert doc["terminationGracePeriodSeconds"] == 100 and doc["capped"] is True
    proc = cli("grace", str(out), "--max", "100")
    assert "WARNING" in proc.stdout
    doc = json.loads(cli("grace", str(out), "--min", "500", "--json").stdout)
    assert doc["terminationGracePeriodSeconds"] == 500
    proc = cli("grace", str(out), "--min", "500", "--max", "100")
    assert proc.returncode == 1 and "minimum" in proc.stderr


def test_grace_counts_the_checkpoints_own_save_time(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # trainer_state.json is written before its own save finishes, so only the manifest has it
    _save(out, 5, _state(5, 10.0, None, []))
    doc = json.loads(cli("grace", str(out), "--json").stdout)
    assert doc["inputs"]["save_max"] is not None and doc["inputs"]["save_max"] > 0


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("none", "no complete checkpoint"),
        ("no-state", "no trainer_state.json"),
        ("hf-state", "no 'preemptible' timings"),
        ("missing-dir", "does not exist"),
    ],
)
def test_grace_errors_are_clear(tmp_path: Path, setup: str, message: str) -> None:
    out = tmp_path / "run"
    out.mkdir()
    if setup == "none":
        _save(out, 1, _state(1, 1.0, 1.0, []), commit=False)
    elif setup == "no-state":
        _save(out, 1, None)
    elif setup == "hf-state":
        _save(out, 1, {"global_step": 1, "log_history": []})
    else:
        out = tmp_path / "nope"
    proc = cli("grace", str(out))
    assert proc.returncode == 1
    assert message in proc.stderr and proc.stderr.startswith("trainer-runtime grace: error:")


def test_usage_errors() -> None:
    assert cli().returncode == 2
    proc = cli("grace", "/x", "--headroom", "lots")
    assert proc.returncode == 2 and "--headroom" in proc.stderr


def test_console_script_is_installed(run_dir: Path) -> None:
    script = Path(sys.executable).with_name("trainer-runtime")
    if not script.exists():
        pytest.skip(f"{script} not installed (pip install -e . creates it)")
    proc = subprocess.run(
        [str(script), "inspect", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )
    assert proc.returncode == 0 and "checkpoint-15" in proc.stdout


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 * 1024**3, "5.0 GiB")],
)
def test_human_size(n: int, text: str) -> None:
    assert human_size(n) == text


def test_grace_reads_the_runtime_record_file(tmp_path: Path) -> None:
    # Checkpoints keep the record in preemptible_state.json (trainer_state.json stays loadable by
    # transformers' TrainerState); the key in trainer_state.json is the older layout.
    out = tmp_path / "run"
    record = _state(10, 120.0, 120.0, [])["preemptible"]
    w = CheckpointWriter(str(out), 10, attempt=2)
    w.begin()
    w.write_json("trainer_state.json", {"global_step": 10, "log_history": []})
    w.write_json("preemptible_state.json", record)
    w.commit()
    proc = cli("grace", str(out), "--headroom", "0", "--exit-margin", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["inputs"]["step_max"] == 120.0 and doc["inputs"]["save_max"] >= 120.0


def test_grace_per_stop_policy(tmp_path: Path) -> None:
    out = tmp_path / "run"
    state = _state(20, 120.0, 120.0, [])
    state["preemptible"]["micro_batch_seconds"] = {"max": 7.5, "count": 20}
    _save(out, 20, state)
    bare = ("--headroom", "0", "--exit-margin", "0", "--json")
    finish = json.loads(cli("grace", str(out), *bare).stdout)
    micro = json.loads(cli("grace", str(out), *bare, "--stop-policy", "micro_batch").stdout)
    assert finish["terminationGracePeriodSeconds"] == 243  # unchanged under finish_step
    assert micro["terminationGracePeriodSeconds"] == 131  # ceil(3 + 7.5 + 120)
    assert micro["inputs"]["micro_batch_max"] == 7.5
