"""Integration for jobs written for the stock ``transformers.Trainer`` (and TRL's trainers).

- one line: ``trainer_runtime.hf.attach(trainer)`` after building the Trainer;
- no line: run the script with ``python -m trainer_runtime.hf.run script.py args`` (or
  ``trainer-runtime launch --transformers -- script.py args``), which attaches to every Trainer.

See docs/transformers-integration.md. Names load lazily (transformers is imported on first use).
"""

from __future__ import annotations

from trainer_runtime._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PreemptibleCallback": "callback",
    "attach": "callback",
    "attach_preemptible": "callback",
    "apply_elastic": "elastic",
    "resolve_resume": "callback",
    "install": "hook",
    "uninstall": "hook",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
