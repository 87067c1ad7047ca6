"""``Trainer.hyperparameter_search`` with the optuna backend (transformers' signature).

Each trial: ``train(trial=trial)`` rebuilds the model from ``model_init`` (seeded), applies the
values ``hp_space(trial)`` returns to ``trainer.args`` (validated like any assignment), trains
with its checkpoints under ``<output_dir>/run-<trial.number>`` (or ``hp_name(trial)``), and its
objective is ``compute_objective`` of the last evaluation during training, or of an
``evaluate()`` after it when none ran. Evaluations during training are reported to optuna, which
may prune the trial. optuna is optional: without it the search fails with a
:class:`~trainer_runtime.errors.ConfigurationError` naming the package.

:class:`HyperparameterSearchMixin` is a base class of :class:`trainer_runtime.trainer.Trainer`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.trainer_utils import (
    BestRun,
    HPSearchBackend,
    default_compute_objective,
    default_hp_space_optuna,
)

__all__ = ["HyperparameterSearchMixin", "import_optuna", "run_optuna"]

logger = logging.getLogger(__name__)

_UNSUPPORTED = {
    "ray": "Ray Tune",
    "wandb": "W&B sweeps",
    "sigopt": "SigOpt",
}


def import_optuna() -> Any:
    """The optuna module, or a ConfigurationError saying how to install it."""
    try:
        return importlib.import_module("optuna")
    except ImportError as exc:
        raise ConfigurationError(
            "hyperparameter_search(backend='optuna') needs the optuna package, which is not "
            "installed: pip install optuna (or install preemptible's dev extra)"
        ) from exc


def _resolve_backend(backend: str | HPSearchBackend | None) -> HPSearchBackend:
    if backend is None:
        # transformers picks the first installed backend; optuna is the only one we run.
        import_optuna()
        return HPSearchBackend.OPTUNA
    name = backend.value if isinstance(backend, HPSearchBackend) else str(backend).lower()
    if name == HPSearchBackend.OPTUNA.value:
        import_optuna()
        return HPSearchBackend.OPTUNA
    if name in _UNSUPPORTED:
        raise ConfigurationError(
            f"hyperparameter_search(backend={name!r}): the {_UNSUPPORTED[name]} backend is not "
            "supported by this runtime; use backend='optuna' (pip install optuna)"
        )
    raise ConfigurationError(
        f"hyperparameter_search(backend={backend!r}): unknown backend; use 'optuna'"
    )


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


class _HpSearchReporter(TrainerCallback):
    """Reports every evaluation during a trial's training to the search (objective, pruning),
    where transformers' training loop calls ``_report_to_hp_search``."""

    def __init__(self, trainer: HyperparameterSearchMixin) -> None:
        self.trainer = trainer

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        trainer = self.trainer
        metrics = kw.get("metrics")
        if getattr(trainer, "is_in_train", False) and metrics is not None:
            trainer._report_to_hp_search(trainer._trial, state.global_step, metrics)


def run_optuna(
    trainer: HyperparameterSearchMixin, n_trials: int, direction: str | list[str], **kwargs: Any
) -> BestRun | list[BestRun]:
    """Run the study: ``kwargs`` go to ``optuna.create_study`` except ``timeout``, ``n_jobs``,
    ``gc_after_trial`` and ``catch``, which go to ``study.optimize`` (as in transformers)."""
    optuna = import_optuna()

    def objective(trial: Any) -> float | list[float]:
        trainer.objective = None
        root = str(trainer.args.output_dir)
        trainer._hp_output_root = root
        try:
            # Trials never resume (the study itself is not checkpointed): False, not None,
            # so $PREEMPTIBLE_RESUME_FROM is not applied to a trial either.
            trainer.train(resume_from_checkpoint=False, trial=trial)  # type: ignore[attr-defined]
            if trainer.objective is None:
                metrics = trainer.evaluate()  # type: ignore[attr-defined]
                trainer.objective = trainer.compute_objective(metrics)
        finally:
            trainer._hp_output_root = None
            trainer.args.output_dir = root
        return trainer.objective  # type: ignore[return-value]

    timeout = kwargs.pop("timeout", None)
    n_jobs = kwargs.pop("n_jobs", 1)
    gc_after_trial = kwargs.pop("gc_after_trial", False)
    catch = kwargs.pop("catch", ())
    directions = direction if isinstance(direction, list) else None
    single = None if directions is not None else direction
    study = optuna.create_study(direction=single, directions=directions, **kwargs)
    study.optimize(
        objective,
        n_trials=n_trials,
        timeout=timeout,
        n_jobs=n_jobs,
        gc_after_trial=gc_after_trial,
        catch=catch,
    )
    if directions is None:
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params)
    return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]


class HyperparameterSearchMixin:
    # Set by the Trainer; declared for readers and type checkers.
    args: Any
    callback_handler: Any
    model_init: Callable[..., Any] | None = None

    hp_search_backend: HPSearchBackend | None = None
    hp_space: Callable[[Any], dict[str, Any]] | None = None
    hp_name: Callable[[Any], str] | None = None
    compute_objective: Callable[[dict[str, float]], float] = staticmethod(  # type: ignore[assignment]
        default_compute_objective
    )
    objective: float | list[float] | None = None
    _trial: Any = None
    # The output_dir the search started from, while a trial runs (its run dir is under it).
    _hp_output_root: str | None = None

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | HPSearchBackend | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun | list[BestRun]:
        """Search hyperparameters with optuna: ``n_trials`` trainings from ``model_init``, each
        with the arguments ``hp_space(trial)`` returns (default: transformers' space of
        learning_rate, num_train_epochs, seed, per_device_train_batch_size), scored by
        ``compute_objective(metrics)`` (default: eval_loss, or the sum of the other metrics).
        Returns the best run (a list of them for several ``direction`` values)."""
        chosen = _resolve_backend(backend)
        if self.model_init is None:
            raise ConfigurationError(
                "hyperparameter_search needs Trainer(model_init=...): every trial starts from a "
                "freshly built model"
            )
        if collectives.world_size() > 1:
            raise ConfigurationError(
                "hyperparameter_search runs in a single process in this runtime; launch it "
                f"without torchrun/accelerate (world size is {collectives.world_size()})"
            )
        self.hp_search_backend = chosen
        self.hp_space = default_hp_space_optuna if hp_space is None else hp_space
        self.hp_name = hp_name
        self.compute_objective = (
            default_compute_objective if compute_objective is None else compute_objective
        )
        reporter = _HpSearchReporter(self)
        self.callback_handler.add_callback(reporter)
        try:
            return run_optuna(self, n_trials, direction, **kwargs)
        finally:
            self.callback_handler.remove_callback(reporter)
            self.hp_search_backend = None
            self._trial = None

    def _get_output_dir(self, trial: Any) -> str:
        """Where a trial's checkpoints go: ``<output_dir>/run-<trial.number>`` or
        ``<output_dir>/<hp_name(trial)>``; output_dir itself outside a search."""
        root = self._hp_output_root or str(self.args.output_dir)
        if self.hp_search_backend is None or trial is None:
            return root
        name = self.hp_name(trial) if self.hp_name is not None else f"run-{trial.number}"
        return _join(root, name)

    def _hp_search_setup(self, trial: Any) -> None:
        """Apply the trial's hyperparameters to ``self.args`` (cast to the field's current type,
        as transformers does) and point output_dir at the trial's run directory."""
        self._trial = trial
        if self.hp_search_backend is None or trial is None:
            return
        assert self.hp_space is not None
        params = self.hp_space(trial)
        for key, value in params.items():
            if not hasattr(self.args, key):
                logger.warning(
                    "hyperparameter search: %r is not a TrainingArguments field; ignored", key
                )
                continue
            old = getattr(self.args, key, None)
            if old is not None:
                value = type(old)(value)
            setattr(self.args, key, value)  # validated by TrainingArguments
        logger.info("trial %s: %s", trial.number, getattr(trial, "params", params))
        # Checkpoints, rotation and the best checkpoint of this trial live in its run dir.
        self.args.output_dir = self._get_output_dir(trial)

    def _report_to_hp_search(self, trial: Any, step: int, metrics: dict[str, float]) -> None:
        """Record the objective of an evaluation during training; optuna may prune the trial."""
        if self.hp_search_backend is None or trial is None:
            return
        self.objective = self.compute_objective(dict(metrics))
        study = getattr(trial, "study", None)
        if study is not None and not study._is_multi_objective():
            trial.report(self.objective, step)
            if trial.should_prune():
                optuna = import_optuna()
                self.callback_handler.on_train_end(self.args, self.state, self.control)  # type: ignore[attr-defined]
                raise optuna.TrialPruned()
