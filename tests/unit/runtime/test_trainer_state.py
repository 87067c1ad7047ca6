from __future__ import annotations

import json

from trainer_runtime.state import TrainerControl, TrainerState


def test_round_trip_with_preemptible_key() -> None:
    state = TrainerState(
        epoch=1.5,
        global_step=12,
        max_steps=40,
        log_history=[{"loss": 0.5, "step": 10}],
        preemptible={
            "step_seconds": {"last": 0.1, "ema": 0.1, "p99": 0.2, "max": 0.3, "count": 12},
            "save_seconds": {"last": 1.0, "max": 1.0, "count": 1},
            "sigterm_to_exit_seconds": [4.2],
            "attempt": 2,
            "data_position": {"kind": "map", "epoch": 1, "batch": 3},
        },
    )
    text = state.to_json_string()
    data = json.loads(text)
    # Hugging Face field names are at the top level
    for key in ("global_step", "epoch", "max_steps", "log_history", "best_metric", "total_flos"):
        assert key in data
    assert TrainerState.from_json_string(text) == state


def test_unknown_keys_from_newer_writers_are_ignored() -> None:
    data = TrainerState(global_step=3).to_dict() | {"some_future_field": 1}
    assert TrainerState.from_dict(data).global_step == 3


def test_control_resets() -> None:
    control = TrainerControl(should_save=True, should_log=True, should_evaluate=True)
    control.should_training_stop = control.should_epoch_stop = True
    control._new_step()
    assert not (control.should_save or control.should_log or control.should_evaluate)
    assert control.should_training_stop
    control._new_epoch()
    assert not control.should_epoch_stop
    control._new_training()
    assert not control.should_training_stop
