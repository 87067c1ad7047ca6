"""Argument checks of the toy training script (no training here)."""

from __future__ import annotations

import pytest

from trainer_runtime.protocol import ENV_OUTPUT_DIR
from trainer_runtime.toy import ToyDataset, parse_args


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-steps", "0", "--output-dir", "/tmp/x"], "--max-steps=0 must be >= 1"),
        (["--save-steps", "-1", "--output-dir", "/tmp/x"], "--save-steps=-1 must be >= 1"),
        ([], f"pass --output-dir URL or set ${ENV_OUTPUT_DIR}"),
        (
            ["--output-dir", "/tmp/x", "--save-sleep", "1", "--enospc-after-bytes", "10"],
            "cannot be combined",
        ),
    ],
)
def test_bad_arguments_name_the_flag_and_the_fix(
    argv: list[str], needle: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv(ENV_OUTPUT_DIR, raising=False)
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    assert needle in capsys.readouterr().err


def test_output_dir_defaults_to_the_operator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_OUTPUT_DIR, "/data/run")
    assert parse_args([]).output_dir == "/data/run"
    assert parse_args(["--output-dir", "/elsewhere"]).output_dir == "/elsewhere"


def test_dataset_is_a_pure_function_of_the_seed() -> None:
    a, b, c = ToyDataset(64, seed=3), ToyDataset(64, seed=3), ToyDataset(64, seed=4)
    assert a.x.equal(b.x) and a.labels.equal(b.labels)
    assert not a.x.equal(c.x)
    assert set(a[0]) == {"x", "labels"}


@pytest.mark.parametrize(("flag", "enabled"), [([], True), (["--jit-checkpoint", "false"], False)])
def test_jit_checkpoint_flag(flag: list[str], enabled: bool, tmp_path: object) -> None:
    """benchmarks/goodput.py's periodic-only policy runs the toy with no JIT save on SIGTERM;
    the default stays on."""
    from trainer_runtime.toy import build_trainer

    args = parse_args(["--output-dir", str(tmp_path), "--max-steps", "2", *flag])
    assert build_trainer(args).args.enable_jit_checkpoint is enabled
