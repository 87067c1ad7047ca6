"""The grace rule: how long a pod needs between SIGTERM and SIGKILL (torch-free, pure).

``grace = ceil(kill_wait + (1 + headroom) * (step_max + save_max)) + exit_margin``, clamped to
``[minimum, maximum]`` (DESIGN.md). The reference example: a step of up to 120 s and a save of up
to 120 s need at least ``grace_seconds(120, 120) == 243`` seconds.

The operator uses :func:`recommend_grace` with the runtime's measurements; before any measurement
the answer is the policy's ``initial_seconds``. SIGTERM-to-exit times observed in earlier attempts
are ground truth: the recommendation never goes below ``ceil(observed * (1 + headroom)) +
exit_margin`` (unless ``maximum`` caps it, which the recommendation reports as insufficient).

Under the ``micro_batch`` stop policy the runtime never finishes a step after SIGTERM: it stops at
the next micro-batch boundary and saves, so the rule's step term is the longest micro-batch:
``ceil(kill_wait + (1 + headroom) * (micro_batch_max + save_max)) + exit_margin``
(:func:`stop_seconds_term`). Under ``finish_step`` (the default) the rule is unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.protocol import DEFAULT_KILL_WAIT_SECONDS, STOP_POLICIES

__all__ = [
    "GracePolicy",
    "GraceRecommendation",
    "grace_seconds",
    "recommend_grace",
    "stop_seconds_term",
]

# Float noise (3 + 1.1 * 240 = 267.00000000000003) must not add a whole second.
_ROUND_DIGITS = 6


def _ceil(value: float) -> int:
    return math.ceil(round(value, _ROUND_DIGITS))


def _check_number(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(
            f"{name}={value!r} is invalid: use a finite number of seconds >= 0"
        )
    if value < 0:
        raise ConfigurationError(f"{name}={value!r} is negative: use a number >= 0")


def _clamp(value: int, minimum: int | None, maximum: int | None) -> int:
    if minimum is not None and maximum is not None and minimum > maximum:
        raise ConfigurationError(
            f"minimum={minimum!r} is greater than maximum={maximum!r}: make minimum <= maximum"
        )
    if minimum is not None:
        value = max(value, math.ceil(minimum))
    if maximum is not None:
        value = min(value, math.floor(maximum))
    return value


def stop_seconds_term(
    stop_policy: str, step_max: float | None, micro_batch_max: float | None
) -> tuple[float | None, str]:
    """The longest work the runtime may still do after kill_wait before it saves, and its name:
    the step under ``finish_step``; under ``micro_batch`` the micro-batch (the step while no
    micro-batch was measured: without gradient accumulation a step is one micro-batch)."""
    if stop_policy == "micro_batch" and micro_batch_max is not None:
        return micro_batch_max, "micro_batch"
    return step_max, "step"


def grace_seconds(
    step_max: float,
    save_max: float,
    *,
    kill_wait: float = DEFAULT_KILL_WAIT_SECONDS,
    headroom: float = 0.0,
    exit_margin: float = 0,
    minimum: float | None = None,
    maximum: float | None = None,
) -> int:
    """``ceil(kill_wait + (1 + headroom) * (step_max + save_max)) + exit_margin``, clamped."""
    for name, value in (
        ("step_max", step_max),
        ("save_max", save_max),
        ("kill_wait", kill_wait),
        ("headroom", headroom),
        ("exit_margin", exit_margin),
    ):
        _check_number(name, value)
    _check_number("minimum", minimum, allow_none=True)
    _check_number("maximum", maximum, allow_none=True)
    raw = _ceil(kill_wait + (1.0 + headroom) * (step_max + save_max)) + math.ceil(exit_margin)
    return _clamp(raw, minimum, maximum)


@dataclass(frozen=True)
class GracePolicy:
    """How the operator turns measurements into a grace period (``spec.gracePeriod`` auto mode).

    Defaults: 300 s before anything is measured (long enough for a first JIT save of a mid-size
    model on a slow volume), clamped to [30 s, 3600 s], 25 % headroom over the worst step + save
    seen (timings vary between nodes and volumes), the 3 s kill_wait of the runtime, and a 5 s exit
    margin for writing the termination message and the interpreter shutting down.
    """

    initial_seconds: int = 300
    minimum: int = 30
    maximum: int = 3600
    headroom: float = 0.25
    kill_wait: float = DEFAULT_KILL_WAIT_SECONDS
    exit_margin: int = 5
    stop_policy: str = "finish_step"
    """finish_step: the rule covers a whole step; micro_batch: one micro-batch (see the module)."""

    def __post_init__(self) -> None:
        for name in (
            "initial_seconds",
            "minimum",
            "maximum",
            "headroom",
            "kill_wait",
            "exit_margin",
        ):
            _check_number(name, getattr(self, name))
        if self.stop_policy not in STOP_POLICIES:
            raise ConfigurationError(
                f"stop_policy={self.stop_policy!r} is not a stop policy: use one of "
                f"{', '.join(STOP_POLICIES)}"
            )
        if self.minimum > self.maximum:
            raise ConfigurationError(
                f"minimum={self.minimum!r} is greater than maximum={self.maximum!r}: "
                "make minimum <= maximum"
            )


@dataclass(frozen=True)
class GraceRecommendation:
    """``seconds`` to use; ``required_seconds`` is the need before clamping to ``maximum``."""

    seconds: int
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)
    required_seconds: int | None = None

    @property
    def capped(self) -> bool:
        """True when ``maximum`` cut the recommendation below what the measurements need."""
        return self.required_seconds is not None and self.required_seconds > self.seconds

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "capped": self.capped}


def _max_of(values: float | Iterable[float] | None) -> float | None:
    if values is None:
        return None
    if isinstance(values, int | float) and not isinstance(values, bool):
        return float(values)
    seq = [float(v) for v in values if v is not None]  # type: ignore[union-attr]
    return max(seq) if seq else None


def recommend_grace(
    step_max: float | None,
    save_max: float | None,
    observed_exit_max: float | Iterable[float] | None = None,
    policy: GracePolicy | None = None,
    micro_batch_max: float | None = None,
) -> GraceRecommendation:
    """The grace period the next attempt should get.

    - No measurement at all: ``policy.initial_seconds`` (clamped).
    - Step and save measured: the grace rule with the policy's headroom, kill_wait, exit_margin.
    - Only one of them measured (e.g. no save yet): the rule with the missing one as 0, but never
      below ``initial_seconds``: the unmeasured part is unknown.
    - Only SIGTERM-to-exit times measured: those alone (they are the whole stop, measured).
    - Observed SIGTERM-to-exit times (a number or a list): never below
      ``ceil(observed_max * (1 + headroom)) + exit_margin``.
    - Finally clamped to ``[minimum, maximum]``; ``required_seconds`` keeps the unclamped need.

    ``micro_batch_max``: the longest micro-batch measured; under ``policy.stop_policy ==
    "micro_batch"`` it replaces ``step_max`` in the rule (see :func:`stop_seconds_term`).
    """
    policy = policy or GracePolicy()
    _check_number("micro_batch_max", micro_batch_max, allow_none=True)
    step_max, term = stop_seconds_term(policy.stop_policy, step_max, micro_batch_max)
    observed = _max_of(observed_exit_max)
    _check_number("step_max", step_max, allow_none=True)
    _check_number("save_max", save_max, allow_none=True)
    _check_number("observed_exit_max", observed, allow_none=True)
    inputs: dict[str, Any] = {
        "step_max": step_max,
        "save_max": save_max,
        "observed_exit_max": observed,
        "initial_seconds": policy.initial_seconds,
        "minimum": policy.minimum,
        "maximum": policy.maximum,
        "headroom": policy.headroom,
        "kill_wait": policy.kill_wait,
        "exit_margin": policy.exit_margin,
        "stop_policy": policy.stop_policy,
        "micro_batch_max": micro_batch_max,
    }
    if step_max is None and save_max is None and observed is None:
        seconds = _clamp(math.ceil(policy.initial_seconds), policy.minimum, policy.maximum)
        return GraceRecommendation(
            seconds, "no measurements yet: initial_seconds", inputs, int(policy.initial_seconds)
        )

    reasons: list[str] = []
    need = 0
    if step_max is not None or save_max is not None:
        need = grace_seconds(
            step_max or 0.0,
            save_max or 0.0,
            kill_wait=policy.kill_wait,
            headroom=policy.headroom,
            exit_margin=policy.exit_margin,
        )
        reasons.append(
            f"grace rule: ceil({policy.kill_wait:g} + {1 + policy.headroom:g} * "
            f"({step_max or 0:g} + {save_max or 0:g})) + {policy.exit_margin:g} = {need}"
            + (" (micro_batch stop: longest micro-batch, not step)" if term != "step" else "")
        )
    if (step_max is None) != (save_max is None):
        missing = "step" if step_max is None else "save"
        if policy.initial_seconds > need:
            need = math.ceil(policy.initial_seconds)
            reasons.append(f"{missing} time not measured yet: at least initial_seconds {need}")
        else:
            reasons.append(f"{missing} time not measured yet")
    if observed is not None:
        floor = _ceil(observed * (1.0 + policy.headroom)) + math.ceil(policy.exit_margin)
        if floor > need:
            reasons.append(
                f"observed SIGTERM-to-exit {observed:g} s needs ceil({observed:g} * "
                f"{1 + policy.headroom:g}) + {policy.exit_margin:g} = {floor}"
            )
            need = floor
    seconds = _clamp(need, policy.minimum, policy.maximum)
    if seconds > need:
        reasons.append(f"raised to minimum {policy.minimum}")
    elif seconds < need:
        reasons.append(
            f"capped at maximum {policy.maximum}: {need} s needed, grace is insufficient"
        )
    return GraceRecommendation(seconds, "; ".join(reasons), inputs, need)
