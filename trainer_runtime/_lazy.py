"""Lazy public names for a package: ``import pkg`` stays cheap and torch-free, and ``pkg.Name``
imports the one module that defines it on first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``; ``exports`` maps a public name to the
    module (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    names = sorted(exports)

    def __dir__() -> list[str]:
        return names

    return names, __getattr__, __dir__
