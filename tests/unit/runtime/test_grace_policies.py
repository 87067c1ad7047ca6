"""The grace rule under both stop policies (trainer_runtime.grace), as a table."""

from __future__ import annotations

import pytest

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.grace import GracePolicy, recommend_grace

BARE = {"headroom": 0.0, "exit_margin": 0, "minimum": 1, "maximum": 100000}


@pytest.mark.parametrize(
    ("stop_policy", "step_max", "micro_batch_max", "save_max", "extra", "expected"),
    [
        # The reference case: a 2 min step and a 2 min save need 243 s under finish_step,
        # whether or not micro-batches were measured.
        ("finish_step", 120, None, 120, {}, 243),
        ("finish_step", 120, 7.5, 120, {}, 243),
        # micro_batch: kill_wait + the longest micro-batch + the save (+ margins)
        ("micro_batch", 120, 7.5, 120, {}, 131),  # ceil(3 + 7.5 + 120)
        ("micro_batch", 120, 7.5, 120, {"headroom": 0.25, "exit_margin": 5}, 168),
        # no micro-batch measured (no gradient accumulation): a step is one micro-batch
        ("micro_batch", 120, None, 120, {}, 243),
        ("micro_batch", 2.0, None, 30, {}, 35),
    ],
)
def test_grace_rule_per_stop_policy(
    stop_policy: str,
    step_max: float,
    micro_batch_max: float | None,
    save_max: float,
    extra: dict,
    expected: int,
) -> None:
    policy = GracePolicy(**{**BARE, **extra, "stop_policy": stop_policy})
    rec = recommend_grace(step_max, save_max, None, policy, micro_batch_max=micro_batch_max)
    assert rec.seconds == expected, rec.reason
    if stop_policy == "micro_batch" and micro_batch_max is not None:
        assert "micro-batch" in rec.reason


def test_micro_batch_policy_still_honours_observed_exit_times() -> None:
    policy = GracePolicy(**BARE, stop_policy="micro_batch")
    rec = recommend_grace(120, 120, 200.0, policy, micro_batch_max=5)
    assert rec.seconds == 200


def test_unknown_stop_policy_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="stop_policy='whole_epoch'"):
        GracePolicy(stop_policy="whole_epoch")
