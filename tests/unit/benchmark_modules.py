"""Benchmarks are scripts, not a package: tests load one by its file name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(filename: str, name: str | None = None) -> ModuleType:
    """``benchmarks/<filename>`` as a module named ``name`` (default: its stem + ``_bench``),
    registered in sys.modules (dataclasses resolve their module by name)."""
    path = BENCHMARKS / filename
    spec = importlib.util.spec_from_file_location(name or f"{path.stem}_bench", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
