"""The operator imports these modules: they must not pull in torch (slow, large, not installed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = [
    "trainer_runtime",
    "trainer_runtime.errors",
    "trainer_runtime.checkpoint.storage",
    "trainer_runtime.checkpoint.layout",
    "trainer_runtime.grace",
    "trainer_runtime.protocol",
    "trainer_runtime.cli",
    # sub-package __init__ files only name their modules (lazily)
    "trainer_runtime.checkpoint",
    "trainer_runtime.data",
    "trainer_runtime.distributed",
    "trainer_runtime.features",
]


def test_operator_side_modules_do_not_import_torch() -> None:
    code = (
        "import trainer_runtime.checkpoint.layout, trainer_runtime.grace, "
        "trainer_runtime.protocol, trainer_runtime.checkpoint.storage; "
        "import sys; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_is_torch_free(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_lazy_exports_resolve_without_torch() -> None:
    code = (
        "import sys, trainer_runtime as t; "
        "t.CheckpointStore, t.CheckpointInfo, t.grace_seconds, t.StorageError, t.GracePolicy; "
        "assert t.grace_seconds(120, 120) == 243; "
        "assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
