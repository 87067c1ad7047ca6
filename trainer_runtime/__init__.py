"""preemptible trainer runtime: a Hugging Face style Trainer that survives preemption.

The public names are loaded lazily so that torch-free modules (``trainer_runtime.checkpoints``,
``trainer_runtime.grace``, ``trainer_runtime.protocol``) can be imported by the operator without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> module that defines it (filled in as modules land)
_EXPORTS: dict[str, str] = {}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer_runtime.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
