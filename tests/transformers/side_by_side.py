"""Run one training script under transformers' Trainer and under ours, and compare the runs.

A *script* is a function ``script(api, output_dir) -> dict`` written once against an
:class:`Api` (``api.Trainer``, ``api.TrainingArguments``, ``api.TrainerCallback``): only those
imports differ between the two runs. It builds its model (with a fixed seed, from
``tests/transformers/models.py``), its data and collator, trains, and returns whatever it wants
compared (``evaluate()`` / ``predict()`` results, the trainer). :func:`run_both` runs it twice,
each in its own output dir, with an :class:`EventRecorder` callback on each trainer, and returns
two :class:`Run` records; the ``assert_*`` helpers compare them with a tight tolerance.

Volatile values (wall-clock runtimes and rates) are compared by key only, never by value.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Keys whose values depend on the wall clock: compared by presence, never by value.
VOLATILE_SUFFIXES = ("_runtime", "_per_second")

# CPU float32, same kernels on both sides: the remaining differences are summation order.
REL_TOL = 1e-5
ABS_TOL = 1e-7

# What every side-by-side script passes to TrainingArguments: CPU, no trackers, no bars.
COMMON_ARGS: dict[str, Any] = {
    "use_cpu": True,
    "report_to": "none",
    "disable_tqdm": True,
    "seed": 42,
    # Both sides read the examples in the same order (random orders come from different samplers).
    "train_sampling_strategy": "sequential",
    "dataloader_num_workers": 0,
}


@dataclass(frozen=True)
class Api:
    """The Trainer API a script runs against: transformers' or ours."""

    name: str
    Trainer: Any
    TrainingArguments: Any
    TrainerCallback: Any
    EarlyStoppingCallback: Any

    def args(self, output_dir: str | Path, **kwargs: Any) -> Any:
        """TrainingArguments with :data:`COMMON_ARGS` (overridable) and ``output_dir``."""
        return self.TrainingArguments(output_dir=str(output_dir), **{**COMMON_ARGS, **kwargs})


def transformers_api() -> Api:
    import transformers

    return Api(
        "transformers",
        transformers.Trainer,
        transformers.TrainingArguments,
        transformers.TrainerCallback,
        transformers.EarlyStoppingCallback,
    )


def ours_api() -> Api:
    import trainer_runtime

    return Api(
        "ours",
        trainer_runtime.Trainer,
        trainer_runtime.TrainingArguments,
        trainer_runtime.TrainerCallback,
        trainer_runtime.EarlyStoppingCallback,
    )


def recorder_class(api: Api) -> type:
    """An event recorder subclassing ``api.TrainerCallback`` (each handler sees its own type)."""

    class EventRecorder(api.TrainerCallback):  # type: ignore[misc, name-defined]
        """Records (event, global_step) for every event, and every ``on_log`` payload."""

        def __init__(self) -> None:
            self.events: list[tuple[str, int]] = []
            self.logs: list[dict[str, Any]] = []

        def _record(self, name: str, state: Any) -> None:
            self.events.append((name, int(state.global_step)))

        def on_train_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self._record("on_train_begin", state)

        def on_train_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self._record("on_train_end", state)

        def on_epoch_begin(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self._record("on_epoch_begin", state)

        def on_epoch_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self._record("on_epoch_end", state)

        def on_evaluate(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self._record("on_evaluate", state)

        def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            self._record("on_save", state)

        def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
            self._record("on_log", state)
            self.logs.append(dict(logs or {}))

    return EventRecorder


@dataclass
class Run:
    """What one side produced."""

    api: str
    output_dir: Path
    trainer: Any
    log_history: list[dict[str, Any]]
    events: list[tuple[str, int]]
    on_log: list[dict[str, Any]]
    results: dict[str, Any] = field(default_factory=dict)

    def train_logs(self) -> list[dict[str, Any]]:
        """The per-step training entries (those with a ``loss``)."""
        return [e for e in self.log_history if "loss" in e]

    def eval_logs(self, prefix: str = "eval") -> list[dict[str, Any]]:
        return [e for e in self.log_history if f"{prefix}_loss" in e]

    def summary(self) -> dict[str, Any]:
        """The end-of-training entry (the one with ``train_runtime``)."""
        found = [e for e in self.log_history if "train_runtime" in e]
        assert found, f"{self.api}: no end-of-training summary in log_history {self.log_history}"
        return found[-1]

    def count(self, event: str) -> int:
        return sum(1 for name, _ in self.events if name == event)


Script = Callable[[Api, Path], Mapping[str, Any]]


def run_one(api: Api, script: Script, output_dir: Path) -> Run:
    """Run ``script`` under ``api``; the script must return ``{"trainer": trainer, ...}`` and
    must have added ``api.recorder`` (see :func:`add_recorder`) to it."""
    output_dir.mkdir(parents=True, exist_ok=True)
    results = dict(script(api, output_dir))
    trainer = results.pop("trainer")
    recorder = next(
        (cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "EventRecorder"),
        None,
    )
    return Run(
        api=api.name,
        output_dir=output_dir,
        trainer=trainer,
        log_history=[dict(e) for e in trainer.state.log_history],
        events=list(recorder.events) if recorder else [],
        on_log=list(recorder.logs) if recorder else [],
        results=results,
    )


def run_both(script: Script, tmp_path: Path) -> tuple[Run, Run]:
    """(transformers' run, our run) of ``script``, each in its own output dir under tmp_path."""
    theirs = run_one(transformers_api(), script, tmp_path / "transformers")
    ours = run_one(ours_api(), script, tmp_path / "ours")
    return theirs, ours


def callbacks(api: Api) -> list[Any]:
    """The callbacks every script passes: an event recorder of ``api``'s callback type."""
    return [recorder_class(api)()]


# -- comparisons ---------------------------------------------------------------------------------
def is_volatile(key: str) -> bool:
    return key.endswith(VOLATILE_SUFFIXES)


def close(a: Any, b: Any, *, rel: float = REL_TOL, abs_: float = ABS_TOL) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isnan(a) and math.isnan(b):
            return True
        return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=abs_)
    return bool(a == b)


def diff_entry(
    theirs: Mapping[str, Any], ours: Mapping[str, Any], *, rel: float = REL_TOL
) -> list[str]:
    """Human-readable differences between two log entries / metric dicts (keys and values)."""
    problems: list[str] = []
    only_theirs = sorted(set(theirs) - set(ours))
    only_ours = sorted(set(ours) - set(theirs))
    if only_theirs:
        problems.append(f"keys only transformers has: {only_theirs}")
    if only_ours:
        problems.append(f"keys only ours has: {only_ours}")
    for key in sorted(set(theirs) & set(ours)):
        if is_volatile(key):
            continue
        if not close(theirs[key], ours[key], rel=rel):
            problems.append(f"{key}: transformers {theirs[key]!r} != ours {ours[key]!r}")
    return problems


def assert_entries_match(
    theirs: list[Mapping[str, Any]],
    ours: list[Mapping[str, Any]],
    what: str,
    *,
    rel: float = REL_TOL,
) -> None:
    assert len(theirs) == len(ours), (
        f"{what}: transformers has {len(theirs)} entries, ours {len(ours)}\n"
        f"transformers: {theirs}\nours: {ours}"
    )
    problems = []
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        problems += [f"{what}[{i}] (step {a.get('step')}): {p}" for p in diff_entry(a, b, rel=rel)]
    assert not problems, "\n".join(problems)


def assert_log_history_match(theirs: Run, ours: Run, *, rel: float = REL_TOL) -> None:
    """Every log_history entry: same count, same keys, same values (loss, grad_norm,
    learning_rate, epoch, eval metrics, summary), volatile values by key only."""
    assert_entries_match(theirs.log_history, ours.log_history, "log_history", rel=rel)


def assert_on_log_match(theirs: Run, ours: Run, *, rel: float = REL_TOL) -> None:
    """What the callbacks (and so the trackers) received through on_log."""
    assert_entries_match(theirs.on_log, ours.on_log, "on_log", rel=rel)


def assert_metrics_match(
    theirs: Mapping[str, Any], ours: Mapping[str, Any], what: str, *, rel: float = REL_TOL
) -> None:
    problems = diff_entry(theirs, ours, rel=rel)
    assert not problems, f"{what}:\n" + "\n".join(problems)


def _to_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return x


def assert_arrays_match(theirs: Any, ours: Any, what: str, *, rel: float = 1e-4) -> None:
    """Nested predictions / label ids: same structure, shapes and values."""
    if isinstance(theirs, (tuple, list)):
        assert isinstance(ours, (tuple, list)) and len(theirs) == len(ours), (
            f"{what}: transformers has {len(theirs)} arrays, ours "
            f"{len(ours) if isinstance(ours, (tuple, list)) else type(ours).__name__}"
        )
        for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
            assert_arrays_match(a, b, f"{what}[{i}]", rel=rel)
        return
    if theirs is None or ours is None:
        assert theirs is None and ours is None, f"{what}: one side is None"
        return
    a, b = np.asarray(_to_numpy(theirs)), np.asarray(_to_numpy(ours))
    assert a.shape == b.shape, f"{what}: shape {a.shape} (transformers) != {b.shape} (ours)"
    np.testing.assert_allclose(b, a, rtol=rel, atol=1e-6, err_msg=what)


def assert_state_dicts_match(
    theirs: Mapping[str, torch.Tensor], ours: Mapping[str, torch.Tensor], what: str
) -> None:
    assert set(theirs) == set(ours), (
        f"{what}: tensor names differ: only transformers {sorted(set(theirs) - set(ours))}, "
        f"only ours {sorted(set(ours) - set(theirs))}"
    )
    for name in sorted(theirs):
        torch.testing.assert_close(
            ours[name],
            theirs[name],
            rtol=REL_TOL,
            atol=1e-6,
            msg=lambda m, n=name: f"{what} {n}: {m}",
        )


def assert_runs_match(theirs: Run, ours: Run, *, rel: float = REL_TOL) -> None:
    """Same log_history (every step's loss, grad_norm, learning_rate, epoch; eval entries; the
    summary), same on_log payloads (what trackers get) and the same callback event order."""
    assert_log_history_match(theirs, ours, rel=rel)
    assert_on_log_match(theirs, ours, rel=rel)
    assert ours.events == theirs.events, (
        f"callback events differ:\ntransformers {theirs.events}\nours         {ours.events}"
    )


def load_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The ``model.safetensors`` of a checkpoint or ``save_model()`` directory."""
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def keys(entries: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    return [sorted(e) for e in entries]


# Trainer-level helpers: build either Trainer with the tier's common arguments and run a function
# under both (used by the evaluation, data and activation-checkpointing tests).

IMPLEMENTATIONS = ("transformers", "ours")


def classes(which: str) -> tuple[type, type]:
    """``(Trainer, TrainingArguments)`` of ``which`` (``"transformers"`` or ``"ours"``)."""
    if which == "transformers":
        import transformers

        return transformers.Trainer, transformers.TrainingArguments
    from trainer_runtime.trainer import Trainer
    from trainer_runtime.training_args import TrainingArguments

    return Trainer, TrainingArguments


def make_trainer(
    which: str, out: Path, *, args: dict[str, Any] | None = None, **kwargs: Any
) -> Any:
    """A Trainer of ``which`` with the tier's common arguments (CPU, no saving, no reporting,
    logging every step) plus ``args``; ``kwargs`` go to the Trainer (model, datasets, ...)."""
    trainer_cls, args_cls = classes(which)
    options: dict[str, Any] = {
        "output_dir": str(out / which),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "max_steps": 3,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "seed": 0,
        "use_cpu": True,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        **(args or {}),
    }
    with warnings.catch_warnings():
        # gradient_checkpointing is a deprecated alias in both implementations.
        warnings.simplefilter("ignore", FutureWarning)
        return trainer_cls(args=args_cls(**options), **kwargs)


def train_losses(trainer: Any) -> list[float]:
    """The per-step training losses of a finished ``train()`` (from ``log_history``)."""
    trainer.train()
    losses = [float(entry["loss"]) for entry in trainer.state.log_history if "loss" in entry]
    assert losses, "no training loss was logged"
    return losses


def both(run: Callable[[str], Any]) -> dict[str, Any]:
    """``run(which)`` for both implementations (transformers first)."""
    return {which: run(which) for which in IMPLEMENTATIONS}


def assert_nested_close(ours: Any, reference: Any, *, atol: float = 1e-5) -> None:
    """Same nesting (tuples/lists), same shapes, values equal within ``atol``."""
    if isinstance(reference, (tuple, list)):
        assert isinstance(ours, (tuple, list)), f"expected a {type(reference).__name__}"
        assert len(ours) == len(reference)
        for a, b in zip(ours, reference, strict=True):
            assert_nested_close(a, b, atol=atol)
        return
    assert isinstance(ours, np.ndarray), f"expected a numpy array, got {type(ours).__name__}"
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=atol, rtol=1e-5)
