"""TrainerState (saved as trainer_state.json) and TrainerControl (the loop's flags)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PREEMPTIBLE_KEY", "TrainerControl", "TrainerState"]

# Key of trainer_state.json that holds this runtime's additions (timings, attempt, data position).
PREEMPTIBLE_KEY = "preemptible"


@dataclass
class TrainerState:
    """Progress of a training run, in Hugging Face's trainer_state.json layout.

    ``preemptible`` holds this runtime's additions: ``step_seconds`` and ``save_seconds``
    (protocol.StepTimings / SaveTimings as dicts), ``sigterm_to_exit_seconds`` (list, one per
    earlier JIT stop), ``attempt`` and ``data_position``.
    """

    epoch: float | None = 0.0  # transformers starts at 0 (evaluate() before train() logs it)
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    preemptible: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerState:
        """Build from a trainer_state.json dict; unknown keys (newer writers) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_json_string(cls, text: str) -> TrainerState:
        return cls.from_dict(json.loads(text))


@dataclass
class TrainerControl:
    """Flags callbacks set to steer the loop; the loop resets the per-step ones after acting."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def state(self) -> dict[str, Any]:
        """Saved under ``stateful_callbacks["TrainerControl"]`` in trainer_state.json, in
        transformers' ExportableState layout (its Trainer expects that entry when it saves a
        run resumed from our checkpoint)."""
        return {"args": dataclasses.asdict(self), "attributes": {}}

    def _new_training(self) -> None:
        self.should_training_stop = False

    def _new_epoch(self) -> None:
        self.should_epoch_stop = False

    def _new_step(self) -> None:
        self.should_save = False
        self.should_evaluate = False
        self.should_log = False
