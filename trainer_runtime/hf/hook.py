"""Attach the integration to every ``transformers.Trainer`` a script builds, without editing it.

:func:`install` wraps ``transformers.Trainer.__init__`` (the base class, so subclasses such as
TRL's ``SFTTrainer`` that call ``super().__init__`` are covered too): when the base ``__init__``
returns, :func:`~trainer_runtime.hf.callback.attach` runs on the new instance. ``python -m
trainer_runtime.hf.run script.py args`` installs it and then runs the script as ``__main__``.

It also wraps ``create_accelerator_and_postprocess`` (``__init__`` calls it, and again a
hyperparameter search), so every DataLoader the Trainer builds, all through
``self.accelerator.prepare``, gets DataLoader workers that a SIGTERM forwarded to the process
group does not kill (:func:`shield_dataloaders`, :mod:`trainer_runtime.data.worker_signals`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

__all__ = ["install", "installed", "shield_dataloaders", "uninstall"]

logger = logging.getLogger(__name__)

_MARK = "__preemptible_wrapped__"


def shield_dataloaders(trainer: Any) -> None:
    """The workers of every DataLoader that goes through ``trainer.accelerator.prepare`` (all of
    transformers' own: train, eval, test) ignore a SIGTERM not sent by the training process, as
    our Trainer's do. Idempotent; a trainer without an accelerator is left as it is."""
    from trainer_runtime.data.worker_signals import shield_prepared_dataloaders

    shield_prepared_dataloaders(getattr(trainer, "accelerator", None))


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

    create = cls.create_accelerator_and_postprocess

    @functools.wraps(create)
    def create_accelerator_and_postprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = create(self, *args, **kwargs)
        shield_dataloaders(self)
        return result

    create_accelerator_and_postprocess.__preemptible_original__ = create  # type: ignore[attr-defined]
    cls.create_accelerator_and_postprocess = create_accelerator_and_postprocess  # type: ignore[method-assign]
    logger.info("preemptible: every transformers.Trainer gets the operator contract")


def uninstall() -> None:
    """Undo :func:`install` (tests)."""
    import transformers

    cls = transformers.Trainer
    for name in ("__init__", "create_accelerator_and_postprocess"):
        original = getattr(getattr(cls, name), "__preemptible_original__", None)
        if original is not None:
            setattr(cls, name, original)
