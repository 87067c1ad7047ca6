"""Decision and argument modules stay importable without torch (the operator side may use them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

MODULES = [
    "trainer_runtime.features.best",
    "trainer_runtime.features.logging_utils",
    "trainer_runtime.features.arguments",
    "trainer_runtime.features.trackers",
    "trainer_runtime.features.early_stopping",
    "trainer_runtime.features.progress",
]


@pytest.mark.parametrize("module", MODULES)
def test_module_does_not_import_torch(module: str) -> None:
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
