"""torchrun's two ranks on a machine without a GPU and no ``use_cpu``: our Trainer refuses before
the first step instead of letting each rank train its own copy (accelerate runs each process as a
single one there; transformers only warns)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.runtime]

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from trainer_runtime import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=sys.argv[1], max_steps=1, report_to=[])
    data = [{"x": torch.randn(4), "labels": torch.randn(1)} for _ in range(8)]
    Trainer(model=torch.nn.Linear(4, 1), args=args, train_dataset=data)
    print("BUILT", flush=True)
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU accelerate sees the ranks")
def test_two_ranks_without_use_cpu_are_refused_naming_the_fix(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = subprocess.run(
        [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", str(script), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "BUILT" not in out, out
    assert "the process group has 2 ranks" in out and "use_cpu=True" in out, out
