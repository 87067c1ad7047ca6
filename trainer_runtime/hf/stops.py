"""Pure decisions of the transformers integration's JIT stops (no transformers import).

The callback (``hf/callback.py``) stops a stock ``transformers.Trainer`` as our Trainer stops
(``jit_stop.py``, decisions in ``deadline.py``): it abandons an evaluation after its current batch,
drops a partial gradient accumulation at a micro-batch boundary when the rest of the step would
not fit the deadline, and never starts a JIT save that cannot finish before the deadline. With an
object-store output dir it keeps only the best checkpoint's copy in the scratch directory and, on
resume, points ``best_model_checkpoint`` at a copy that exists on this pod.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from trainer_runtime.checkpoint.layout import parse_step
from trainer_runtime.deadline import StopPolicy
from trainer_runtime.protocol import ENV_STOP_POLICY

__all__ = [
    "EvaluationAbandoned",
    "best_copy",
    "deadline_message",
    "stop_policy",
    "superseded_copies",
]

_POLICIES: tuple[StopPolicy, ...] = ("finish_step", "micro_batch")


class EvaluationAbandoned(BaseException):
    """Raised from ``on_prediction_step`` when every rank agreed to stop for a JIT checkpoint:
    transformers' evaluation loop has no stop of its own. Caught by the integration's wrapper
    around ``evaluate`` / ``predict``. A ``BaseException`` so that a script's or a library's
    ``except Exception`` around an evaluation does not swallow the stop."""


def stop_policy(args: Any, env: Mapping[str, str] | None = None) -> StopPolicy:
    """The job's stop policy: ``args.jit_stop_policy`` (our TrainingArguments has it, stock
    transformers' has not), else ``$PREEMPTIBLE_STOP_POLICY``, else ``finish_step``; an
    unknown value is ``finish_step`` (the safe one: it stops inside a step only when the step
    cannot fit)."""
    env = os.environ if env is None else env
    value = getattr(args, "jit_stop_policy", None) or env.get(ENV_STOP_POLICY) or "finish_step"
    value = str(value).strip().lower()
    return value if value in _POLICIES else "finish_step"  # type: ignore[return-value]


def superseded_copies(names: Iterable[str], best: str | None) -> list[str]:
    """Which entries of the scratch run directory to remove after a checkpoint is committed on
    the store: every ``checkpoint-<step>`` directory except the one ``best`` (the basename of
    ``state.best_model_checkpoint``, None: no best) names; sorted."""
    return sorted(n for n in names if parse_step(n) is not None and n != best)


def best_copy(best_path: str | None, resumed_local: str) -> tuple[str, str] | None:
    """Where the best checkpoint's copy goes on this pod after a resume from an object store.

    ``best_path``: ``best_model_checkpoint`` as the checkpoint's ``trainer_state.json`` records
    it (a scratch path of the pod that saved it); ``resumed_local``: where the resumed checkpoint
    was downloaded. Returns ``(name, local path)``: the best checkpoint's directory name and its
    path next to the resumed copy (the same path when the best one is the resumed one); None when
    there is no best checkpoint."""
    if not best_path:
        return None
    name = os.path.basename(best_path.rstrip("/"))
    if parse_step(name) is None:
        return None
    return name, os.path.join(os.path.dirname(resumed_local.rstrip("/")), name)


def deadline_message(
    *,
    save_seconds: float | None,
    seconds_left: float | None,
    grace_seconds: float | None,
    node_notice_seconds: float | None,
    step: int,
    last_complete: int | None,
) -> str:
    """The termination message's detail when the JIT save was not started (deadline too short);
    the same wording as our Trainer's."""
    left = f"{seconds_left:.2f} s" if seconds_left is not None else "no time"
    return (
        f"deadline too short: the longest save took {save_seconds or 0:.2f} s but {left} "
        f"remained before the deadline (grace {grace_seconds} s, node notice "
        f"{node_notice_seconds} s); exited without writing a checkpoint at step {step}, the "
        f"newest complete one is step {last_complete or 0}"
    )
