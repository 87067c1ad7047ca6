"""A script shaped like transformers' examples (``HfArgumentParser`` builds its arguments) under
the operator's environment, with a real SIGTERM (tier 2).

transformers' parser gave a ``bool`` field whose default comes from a ``default_factory`` the
default False, so such a script got no JIT checkpoint under the operator (issue 37, item 0). Here
it writes one and exits 75; ``--enable_jit_checkpoint false`` on its command line still wins.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the script needs transformers (dev extra)")

from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED, TerminationMessage

HERE = Path(__file__).parent
SCRIPT = HERE / "hf_parser_script.py"
ROOT = HERE.parent.parent
TIMEOUT = 240.0
# Periodic saves never fall due: the only checkpoint is the JIT one.
ARGV = (
    "--max_steps", "200", "--save_steps", "1000", "--step_sleep", "0.2",
    "--per_device_train_batch_size", "4", "--use_cpu", "--report_to", "none",
    "--dataloader_num_workers", "0", "--disable_tqdm", "true",
)  # fmt: skip


def _start(out: Path, workdir: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        PREEMPTIBLE_OUTPUT_DIR=str(out),
        PREEMPTIBLE_ATTEMPT="1",
        PREEMPTIBLE_RESUME_FROM="latest",
        PREEMPTIBLE_KILL_WAIT_SECONDS="0",
        PREEMPTIBLE_TERMINATION_LOG=str(workdir / "term"),
    )
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "log.txt"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-P", str(SCRIPT), *ARGV, *extra],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=sink,
        )
    return proc, log


def _wait_for(proc: subprocess.Popen[bytes], log: Path, marker: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while marker not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {marker!r}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"no {marker!r} within {TIMEOUT} s:\n{log.read_text()}")
        time.sleep(0.05)


def _sigterm_and_wait(proc: subprocess.Popen[bytes], log: Path) -> int:
    _wait_for(proc, log, "STEP 2\n")
    os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running after SIGTERM:\n{log.read_text()}") from None


def test_parsed_arguments_get_the_jit_checkpoint_under_the_operator(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc, log = _start(out, tmp_path / "work")
    code = _sigterm_and_wait(proc, log)
    text = log.read_text(errors="replace")
    assert "ARGS enable_jit_checkpoint=True" in text, text
    assert code == EXIT_PREEMPTED, f"exit {code}, expected {EXIT_PREEMPTED}:\n{text}"
    msg = TerminationMessage.model_validate_json((tmp_path / "work" / "term").read_text())
    assert msg.reason == "preempted" and msg.complete is True, msg
    assert msg.step >= 2 and msg.checkpoint is not None, msg
    info = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert info.complete, info.reason


def test_explicit_false_on_the_command_line_still_wins(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc, log = _start(out, tmp_path / "work", "--enable_jit_checkpoint", "false")
    code = _sigterm_and_wait(proc, log)
    text = log.read_text(errors="replace")
    assert "ARGS enable_jit_checkpoint=False" in text, text
    # No handler installed: the SIGTERM ends the process, no checkpoint is written.
    assert code == -signal.SIGTERM, f"exit {code}:\n{text}"
    assert not any(out.glob("checkpoint-*")), sorted(p.name for p in out.iterdir())
