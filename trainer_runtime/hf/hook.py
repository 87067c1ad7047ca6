"""Attach the integration to every ``transformers.Trainer`` a script builds, without editing it.

:func:`install` wraps ``transformers.Trainer.__init__`` (the base class, so subclasses such as
TRL's ``SFTTrainer`` that call ``super().__init__`` are covered too): when the base ``__init__``
returns, :func:`~trainer_runtime.hf.callback.attach` runs on the new instance. ``python -m
trainer_runtime.hf.run script.py args`` installs it and then runs the script as ``__main__``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["install", "installed", "uninstall"]

logger = logging.getLogger(__name__)

_MARK = "__preemptible_wrapped__"


def installed() -> bool:
    import transformers

    return bool(getattr(transformers.Trainer.__init__, _MARK, False))


def install() -> None:
    """Patch ``transformers.Trainer.__init__`` once (idempotent)."""
    import transformers

    from trainer_runtime.hf.callback import attach

    cls = transformers.Trainer
    if getattr(cls.__init__, _MARK, False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attach(self)

    setattr(__init__, _MARK, True)
    __init__.__preemptible_original__ = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[method-assign]
    logger.info("preemptible: every transformers.Trainer gets the operator contract")


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    import transformers

    init = transformers.Trainer.__init__
    original = getattr(init, "__preemptible_original__", None)
    if original is not None:
        transformers.Trainer.__init__ = original  # type: ignore[method-assign]
