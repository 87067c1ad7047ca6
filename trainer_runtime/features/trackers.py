"""Experiment trackers (``report_to``) as Trainer callbacks.

* ``"none"`` (the default) or an empty list: no tracker.
* ``"all"``: every implemented tracker whose package is installed.
* A name or list of names: those trackers; one whose package is not installed is skipped with a
  warning that says what to install (training does not fail for a missing tracker).

Implemented here: ``tensorboard`` (event files through ``torch.utils.tensorboard``), ``trackio``,
``wandb``, ``mlflow``. The other names of the reference docs are recognised and rejected with a
clear error, since this runtime has no integration for them.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.state import TrainerControl, TrainerState

__all__ = [
    "IMPLEMENTED_INTEGRATIONS",
    "KNOWN_INTEGRATIONS",
    "MLflowCallback",
    "TensorBoardCallback",
    "TrackioCallback",
    "WandbCallback",
    "default_tensorboard_dir",
    "is_integration_available",
    "normalize_report_to",
    "reporting_callbacks",
    "resolve_report_to",
    "rewrite_logs",
]

logger = logging.getLogger(__name__)

# Names the reference docs list for report_to.
KNOWN_INTEGRATIONS = (
    "azure_ml",
    "clearml",
    "codecarbon",
    "comet_ml",
    "dagshub",
    "dvclive",
    "flyte",
    "mlflow",
    "swanlab",
    "tensorboard",
    "trackio",
    "wandb",
)
# name -> the package that must be importable
IMPLEMENTED_INTEGRATIONS: dict[str, str] = {
    "tensorboard": "tensorboard",
    "trackio": "trackio",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
ENV_TENSORBOARD_DIR = "TENSORBOARD_LOGGING_DIR"


def normalize_report_to(value: str | Sequence[str] | None) -> list[str]:
    """Validate ``report_to``: a list of implemented names, ``["all"]``, or ``[]`` for none."""
    if value is None:
        return []
    names = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for name in names:
        if name == "none":
            continue
        if name == "all":
            return ["all"]
        if name not in KNOWN_INTEGRATIONS:
            raise ConfigurationError(
                f"report_to={value!r}: unknown integration {name!r}; use 'none', 'all' or some "
                f"of {', '.join(IMPLEMENTED_INTEGRATIONS)}"
            )
        if name not in IMPLEMENTED_INTEGRATIONS:
            raise ConfigurationError(
                f"report_to={value!r}: this runtime has no {name!r} integration; use "
                f"{', '.join(IMPLEMENTED_INTEGRATIONS)} (or a callback of your own)"
            )
        if name not in out:
            out.append(name)
    return out


def is_integration_available(name: str) -> bool:
    package = IMPLEMENTED_INTEGRATIONS.get(name)
    return package is not None and importlib.util.find_spec(package) is not None


def resolve_report_to(value: str | Sequence[str] | None) -> tuple[list[str], list[str]]:
    """``(enabled, skipped_messages)``: "all" enables every installed integration; a requested
    integration whose package is missing is skipped with a message."""
    names = normalize_report_to(value)
    if names == ["all"]:
        return [n for n in IMPLEMENTED_INTEGRATIONS if is_integration_available(n)], []
    enabled, skipped = [], []
    for name in names:
        if is_integration_available(name):
            enabled.append(name)
        else:
            skipped.append(
                f"report_to includes {name!r} but the {IMPLEMENTED_INTEGRATIONS[name]!r} package "
                f"is not installed: skipping it (install {IMPLEMENTED_INTEGRATIONS[name]!r} to "
                "report there)"
            )
    return enabled, skipped


def reporting_callbacks(value: str | Sequence[str] | None) -> list[TrainerCallback]:
    """The callbacks for ``report_to``; skipped integrations are logged as warnings."""
    enabled, skipped = resolve_report_to(value)
    for message in skipped:
        logger.warning(message)
    classes: dict[str, type[TrainerCallback]] = {
        "tensorboard": TensorBoardCallback,
        "trackio": TrackioCallback,
        "wandb": WandbCallback,
        "mlflow": MLflowCallback,
    }
    return [classes[name]() for name in enabled]


def rewrite_logs(logs: Mapping[str, Any]) -> dict[str, float]:
    """Numeric log values grouped for dashboards: ``eval_loss`` -> ``eval/loss``,
    ``test_x`` -> ``test/x``, anything else -> ``train/<name>``."""
    out: dict[str, float] = {}
    for key, value in logs.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for prefix in ("eval", "test"):
            if key.startswith(f"{prefix}_"):
                out[f"{prefix}/{key[len(prefix) + 1 :]}"] = value
                break
        else:
            out[f"train/{key}"] = value
    return out


def _args_dict(args: Any) -> dict[str, Any]:
    to_dict = getattr(args, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else {}


def default_tensorboard_dir(args: Any) -> str:
    """``$TENSORBOARD_LOGGING_DIR``, ``args.logging_dir``, or ``<output_dir>/runs/<run>`` where
    ``<run>`` is ``run_name`` or a timestamp and host name. Must be a local path."""
    explicit = os.environ.get(ENV_TENSORBOARD_DIR) or getattr(args, "logging_dir", None)
    if explicit:
        return str(explicit)
    output_dir = str(getattr(args, "output_dir", None) or ".")
    if output_dir.startswith("file://"):
        output_dir = output_dir[len("file://") :]
    if "://" in output_dir:
        raise ConfigurationError(
            f"report_to='tensorboard' writes event files to a local directory, and output_dir="
            f"{output_dir!r} is remote: set ${ENV_TENSORBOARD_DIR} to a local path (e.g. a "
            "mounted volume)"
        )
    run = getattr(args, "run_name", None) or (
        f"{datetime.datetime.now():%b%d_%H-%M-%S}_{socket.gethostname()}"
    )
    return os.path.join(output_dir, "runs", run)


class TensorBoardCallback(TrainerCallback):
    """Writes every numeric log entry as a TensorBoard scalar at ``state.global_step``."""

    def __init__(self, log_dir: str | None = None) -> None:
        if not is_integration_available("tensorboard"):
            raise ConfigurationError(
                "TensorBoardCallback needs the 'tensorboard' package: install it, or drop "
                "'tensorboard' from report_to"
            )
        self.log_dir = log_dir
        self.writer: Any = None

    def _open(self, args: Any) -> None:
        if self.writer is not None:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = self.log_dir or default_tensorboard_dir(args)
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if not state.is_world_process_zero:
            return
        self._open(args)
        params = _args_dict(args)
        if params:
            import json

            self.writer.add_text("args", json.dumps(params, indent=2, default=str))

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if not state.is_world_process_zero:
            return
        self._open(args)  # evaluate() may run without train()
        for tag, value in rewrite_logs(kw.get("logs") or {}).items():
            self.writer.add_scalar(tag, value, state.global_step)
        self.writer.flush()

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbCallback(TrainerCallback):
    """Weights & Biases: one run per training (``run_name``; project from ``$WANDB_PROJECT``,
    else ``project``). Offline mode and credentials are wandb's own settings."""

    def __init__(self) -> None:
        self._wandb = importlib.import_module("wandb")
        self._started = False

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if not state.is_world_process_zero or self._wandb.run is not None:
            return
        project = os.environ.get("WANDB_PROJECT") or getattr(args, "project", None) or "huggingface"
        self._wandb.init(
            project=project, name=getattr(args, "run_name", None), config=_args_dict(args)
        )
        # Plot against the global step, and let every log() commit at once (a resumed run's
        # steps start again from its checkpoint, so wandb's own step counter is not used).
        self._wandb.define_metric("train/global_step")
        self._wandb.define_metric("*", step_metric="train/global_step", step_sync=True)
        self._started = True

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if not state.is_world_process_zero or self._wandb.run is None:
            return
        logs = rewrite_logs(kw.get("logs") or {})
        logs["train/global_step"] = state.global_step
        self._wandb.log(logs)

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if self._started and self._wandb.run is not None:
            self._wandb.finish()
        self._started = False


class MLflowCallback(TrainerCallback):
    """MLflow: starts a run named ``run_name`` unless one is active; logs numeric metrics."""

    def __init__(self) -> None:
        self._mlflow = importlib.import_module("mlflow")
        self._started = False
        self.run_id: str | None = None

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if not state.is_world_process_zero or self._mlflow.active_run() is not None:
            return
        run = self._mlflow.start_run(run_name=getattr(args, "run_name", None))
        self.run_id = run.info.run_id
        self._started = True
        params = {k: str(v)[:500] for k, v in _args_dict(args).items()}
        if params:
            self._mlflow.log_params(params)

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if not state.is_world_process_zero or self._mlflow.active_run() is None:
            return
        metrics = {
            k: float(v)
            for k, v in (kw.get("logs") or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if metrics:
            self._mlflow.log_metrics(metrics, step=state.global_step)

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if self._started and self._mlflow.active_run() is not None:
            self._mlflow.end_run()
        self._started = False


class TrackioCallback(TrainerCallback):
    """Trackio: ``trackio.init(project=project, name=run_name)``, then one ``log`` per entry."""

    def __init__(self) -> None:
        self._trackio = importlib.import_module("trackio")
        self._started = False

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if not state.is_world_process_zero:
            return
        self._trackio.init(
            project=getattr(args, "project", None) or "huggingface",
            name=getattr(args, "run_name", None),
            config=_args_dict(args),
        )
        self._started = True

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any) -> Any:
        if not state.is_world_process_zero or not self._started:
            return
        logs = rewrite_logs(kw.get("logs") or {})
        logs["train/global_step"] = state.global_step
        self._trackio.log(logs)

    def on_train_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if self._started:
            self._trackio.finish()
        self._started = False
