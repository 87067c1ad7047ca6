"""The launcher wraps torchrun without importing torch; the argument and re-sharding modules are
imported by TrainingArguments, which stays torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "trainer_runtime.distributed.launch",
        "trainer_runtime.distributed.ddp_args",
        "trainer_runtime.checkpoint.resharding",
    ],
)
def test_module_is_torch_free(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_launch_help_without_torch() -> None:
    code = (
        "import sys\n"
        "from trainer_runtime.cli import main\n"
        "try:\n"
        "    main(['launch', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node" in proc.stdout
