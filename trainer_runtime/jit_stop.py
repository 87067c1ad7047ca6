"""The Trainer's JIT stops that do not wait for the step to end (decisions: ``deadline.py``).

- Inside a gradient-accumulation step, at every micro-batch boundary, all ranks agree (one
  all-reduce MAX) whether to drop the partial accumulation: the weights, optimizer and scheduler
  have not moved since the last completed step, so the step's RNG state, data position, token and
  FLO counts are put back as they were when it began, and that step is saved at once. The dropped
  micro-batches are trained again after resume, so the resumed run stays bit-identical.
- Inside an evaluation during training, at every batch, all ranks agree whether to abandon it (an
  evaluation does not change the training state); the JIT checkpoint is written with the RNG state
  from before the evaluation and records it as pending, and the resumed run evaluates first.
- Before a JIT save, all ranks agree whether the longest save seen can finish before the deadline
  with the exit reserve kept back (the longest post-commit work measured, plus the teardown:
  ``deadline.exit_reserve``); when it cannot, nothing is written (a save SIGKILLed half-way is
  worth nothing) and the process exits at once with termination reason ``deadline_too_short``.

The signal handler still only sets the latch (signals.py); everything here runs in the loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from trainer_runtime.checkpoint.rng import capture_rng_state
from trainer_runtime.data.arguments import has_dataset_state
from trainer_runtime.deadline import (
    Action,
    DueSave,
    due_save_action,
    exit_reserve,
    micro_batch_action,
    save_action,
)
from trainer_runtime.distributed import collectives
from trainer_runtime.protocol import ENV_SAVE_INTERVAL_SECONDS
from trainer_runtime.signals import float_from_env

__all__ = ["EvaluationAbandoned", "JitStopMixin", "StepSnapshot", "save_interval_from_env"]

logger = logging.getLogger(__name__)

# Key of the runtime record (preemptible_state.json) that marks an abandoned evaluation.
PENDING_EVALUATION = "pending_evaluation"


def save_interval_from_env() -> float | None:
    """$PREEMPTIBLE_SAVE_INTERVAL_SECONDS (spec.checkpoint.interval: auto), or None."""
    value = float_from_env(ENV_SAVE_INTERVAL_SECONDS, None)
    return value if value else None


class EvaluationAbandoned(Exception):
    """Raised inside an evaluation during training when all ranks agreed to stop for a JIT save."""


@dataclass
class StepSnapshot:
    """What a dropped step must put back: the state when the step began."""

    rng: tuple[dict[str, torch.Tensor], dict[str, str]]
    epoch: int
    num_input_tokens_seen: int
    current_flos: float


class JitStopMixin:
    """Micro-batch stops, abandoned evaluations and the save-fits-deadline check of the Trainer.

    Relies on the Trainer's ``args``, ``state``, ``control``, ``sigterm_latch``, ``save_timer``,
    ``micro_batch_timer``, ``last_checkpoint``, ``_position``, ``current_flos``, ``model``,
    ``optimizer``, ``train_dataset``, ``_is_iterable``, ``_stop_for_preemption`` and
    ``_checkpoints`` (the CheckpointManager: a write in flight at a stop without a save).
    """

    _rng_for_checkpoint: tuple[dict[str, torch.Tensor], dict[str, str]] | None = None
    _jit_stop_kind: str | None = None
    _in_loop_evaluation = False
    _deadline_message: str | None = None
    _save_interval: float | None = None
    _interval_anchor: tuple[int | None, float] | None = None
    # The longest post-commit work measured (rotation, barrier, on_save), earlier attempts too.
    _post_commit_seconds: float | None = None
    # A periodic save fell due after a SIGTERM: the stop happens at this step boundary
    # (became_jit), or, kill_wait still running, it is left to the stop's JIT save (deferred).
    _save_became_jit = False
    _save_deferred = False

    # -- the operator's checkpoint interval ----------------------------------------------------
    def _maybe_save_on_interval(self) -> None:
        """spec.checkpoint.interval auto: ask for a save once the recommended seconds passed since
        the last checkpoint (any: periodic, interval or resumed-from). Ranks agree (rank clocks
        differ), one all-reduce per step, only when the interval is set."""
        if self._save_interval is None:
            return
        last = self.last_checkpoint  # type: ignore[attr-defined]
        step = last.step if last is not None else None
        now = time.monotonic()
        if self._interval_anchor is None or self._interval_anchor[0] != step:
            self._interval_anchor = (step, now)
        due = now - self._interval_anchor[1] >= self._save_interval
        if collectives.agree_to_stop(due):
            self.control.should_save = True  # type: ignore[attr-defined]

    # -- micro-batch stops ---------------------------------------------------------------------
    def _micro_batch_stops(self) -> bool:
        """Whether this run decides at micro-batch boundaries: JIT on and accumulation > 1, and
        the data position can be put back (an iterable dataset that keeps its own position in
        state_dict() cannot be rewound; such a run always finishes its step)."""
        args: Any = self.args  # type: ignore[attr-defined]
        if not args.enable_jit_checkpoint or args.gradient_accumulation_steps <= 1:
            return False
        return not (self._is_iterable() and has_dataset_state(self.train_dataset))  # type: ignore[attr-defined]

    def _step_snapshot(self) -> StepSnapshot | None:
        """Taken when a step begins (before its micro-batches are read), when it may be dropped."""
        if not self._micro_batch_stops():
            return None
        return StepSnapshot(
            rng=capture_rng_state(),
            epoch=self._position.epoch,  # type: ignore[attr-defined]
            num_input_tokens_seen=self.state.num_input_tokens_seen,  # type: ignore[attr-defined]
            current_flos=float(self.current_flos),  # type: ignore[attr-defined]
        )

    def _stop_inside_step(
        self, snapshot: StepSnapshot | None, micro_batches_left: int, per_batch: float
    ) -> bool:
        """At a micro-batch boundary: True (on every rank) when the step must be dropped now.

        ``per_batch``: this step's mean micro-batch time so far, the estimate before any step
        was measured. Every rank joins the collective at every boundary, so they agree.
        """
        if snapshot is None:
            return False
        latch = self.sigterm_latch  # type: ignore[attr-defined]
        estimate = self.micro_batch_timer.max  # type: ignore[attr-defined]
        action = micro_batch_action(
            policy=self.args.jit_stop_policy,  # type: ignore[attr-defined]
            acting=bool(latch and latch.should_act()),
            seconds_left=latch.seconds_left() if latch else None,
            micro_batches_left=micro_batches_left,
            micro_batch_seconds=max(estimate or 0.0, per_batch) or None,
            save_seconds=self._save_estimate(),
            exit_seconds=self._exit_reserve(),
        )
        if snapshot.epoch != self._position.epoch:  # type: ignore[attr-defined]
            # The step's data started a new epoch (an iterable dataset ran out at the step
            # boundary, on_epoch_end already ran): not rewound, the step is finished instead.
            action = Action.CONTINUE
        return collectives.agree_max(int(action)) >= Action.DROP_STEP

    def _drop_partial_step(self, snapshot: StepSnapshot, micro_batches: int) -> None:
        """Put the state back as it was when the step began, then stop for preemption."""
        self._position.batch -= micro_batches  # type: ignore[attr-defined]
        self.state.num_input_tokens_seen = snapshot.num_input_tokens_seen  # type: ignore[attr-defined]
        self.current_flos = snapshot.current_flos  # type: ignore[attr-defined]
        # The accumulated gradients are thrown away (the checkpoint never holds them anyway).
        self.optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        self._rng_for_checkpoint = snapshot.rng
        logger.warning(
            "dropping the partial gradient accumulation of step %d (%d micro-batches to be "
            "trained again after resume): saving step %d now",
            self.state.global_step + 1,  # type: ignore[attr-defined]
            micro_batches,
            self.state.global_step,  # type: ignore[attr-defined]
        )
        self._stop_for_preemption(kind="micro_batch")  # type: ignore[attr-defined]

    # -- the save must fit the deadline --------------------------------------------------------
    def _save_estimate(self) -> float | None:
        """What a JIT save is expected to take: the longest of the recent saves that blocked
        training (earlier attempts included; background writes not), or None before any."""
        return self.save_timer.jit_estimate  # type: ignore[attr-defined]

    def _exit_reserve(self) -> float:
        """Seconds kept back before the deadline for what follows the commit."""
        return exit_reserve(self._post_commit_seconds)

    def _record_post_commit(self, seconds: float) -> None:
        """The post-commit work of a save just measured: the reserve follows the longest."""
        if self._post_commit_seconds is None or seconds > self._post_commit_seconds:
            self._post_commit_seconds = seconds

    def _periodic_save_becomes_jit(self) -> bool:
        """A periodic save is due at this step boundary. True when it is not written here: a
        SIGTERM arrived on some rank (all agree; one collective, on save steps only) and the stop
        that follows writes it as the JIT save, now (:meth:`should_stop`) or, ``kill_wait``
        still running, at its later step (:func:`~trainer_runtime.deadline.due_save_action`)."""
        if self._save_became_jit:
            return True  # already agreed at this boundary (an epoch end's save after a step's)
        args: Any = self.args  # type: ignore[attr-defined]
        control = self.control  # type: ignore[attr-defined]
        finished = bool(control.should_training_stop)
        if not args.enable_jit_checkpoint or not control.should_save or finished:
            return False  # the same on every rank: no collective
        latch = self.sigterm_latch  # type: ignore[attr-defined]
        level = 0 if latch is None or not latch.triggered else (2 if latch.should_act() else 1)
        action = due_save_action(
            jit_enabled=True,
            sigterm=collectives.agree_max(level),
            training_finished=finished,
        )
        if action == DueSave.PERIODIC:
            return False
        step = self.state.global_step  # type: ignore[attr-defined]
        if action == DueSave.JIT_NOW:
            logger.warning(
                "a periodic save is due at step %d after SIGTERM: written as the JIT checkpoint",
                step,
            )
            self._save_became_jit = True
        else:
            logger.warning(
                "a periodic save is due at step %d during the kill wait after SIGTERM: left to "
                "the JIT checkpoint that follows it",
                step,
            )
            self._save_deferred = True
        return True

    def _save_fits_deadline(self) -> bool:
        """All ranks agree whether the JIT save, and the exit reserve after its commit, can
        finish before the deadline. A step that is already saved needs no save: it always
        fits."""
        last = self.last_checkpoint  # type: ignore[attr-defined]
        if last is not None and last.step == self.state.global_step:  # type: ignore[attr-defined]
            return True
        latch = self.sigterm_latch  # type: ignore[attr-defined]
        action = save_action(
            seconds_left=latch.seconds_left() if latch else None,
            save_seconds=self._save_estimate(),
            exit_seconds=self._exit_reserve(),
        )
        return collectives.agree_max(int(action)) < Action.SKIP_SAVE

    def _exit_without_save(self) -> None:
        """Not even the save fits: write nothing, stop now (termination: deadline_too_short)."""
        latch = self.sigterm_latch  # type: ignore[attr-defined]
        left = latch.seconds_left() if latch else None
        last = self.last_checkpoint  # type: ignore[attr-defined]
        self._jit_stop_kind = "no_save"
        self._deadline_message = (
            f"deadline too short: the longest save took {self._save_estimate() or 0:.2f} s and "
            f"{self._exit_reserve():.2f} s are kept back for the exit after its commit, but "
            + (f"{left:.2f} s" if left is not None else "no time")
            + f" remained before the deadline (grace {latch.grace_seconds if latch else None} s, "
            f"node notice {latch.node_notice_seconds if latch else None} s); exited without "
            f"writing a checkpoint at step {self.state.global_step}, the newest complete one is "  # type: ignore[attr-defined]
            f"step {last.step if last else 0}"
        )
        logger.error("DEADLINE TOO SHORT: %s", self._deadline_message)
        self._settle_async_save_before(left)
        self.preempted = True
        self.control.should_training_stop = True  # type: ignore[attr-defined]

    def _settle_async_save_before(self, seconds_left: float | None) -> None:
        """No JIT save: a background write in flight is committed if every rank's finishes
        within the time left (a newer complete checkpoint), else cancelled; never waited for
        past the deadline (checkpointing.py)."""
        budget = None if seconds_left is None else max(0.0, seconds_left - self._exit_reserve())
        self._checkpoints.settle_before_deadline(budget)  # type: ignore[attr-defined]

    # -- evaluation during training ------------------------------------------------------------
    def _evaluate_during_training(self, skip_scheduler: bool = False) -> dict[str, float]:
        """The evaluation of the training loop; a SIGTERM abandons it at the next batch."""
        if getattr(self, "preempted", False):
            return {}  # already stopped for preemption (an abandoned evaluation): nothing more
        if not self.args.enable_jit_checkpoint:  # type: ignore[attr-defined]
            return super()._evaluate_during_training(skip_scheduler)  # type: ignore[misc]
        rng = capture_rng_state()
        self._in_loop_evaluation = True
        try:
            return super()._evaluate_during_training(skip_scheduler)  # type: ignore[misc]
        except EvaluationAbandoned:
            # The training state is that of the completed step; the RNG as before the evaluation
            # so that the evaluation after resume draws the same numbers.
            self._rng_for_checkpoint = rng
            self.state.preemptible[PENDING_EVALUATION] = {"skip_scheduler": skip_scheduler}  # type: ignore[attr-defined]
            self.control.should_evaluate = False  # type: ignore[attr-defined]
            self.control.should_save = False  # type: ignore[attr-defined]
            logger.warning(
                "evaluation at step %d abandoned for the JIT checkpoint; it runs again after "
                "resume",
                self.state.global_step,  # type: ignore[attr-defined]
            )
            self._stop_for_preemption(kind="evaluation")  # type: ignore[attr-defined]
            return {}
        finally:
            self._in_loop_evaluation = False

    def _check_abandon_evaluation(self) -> None:
        """After each evaluation batch in the training loop: all ranks agree whether to stop."""
        if not self._in_loop_evaluation:
            return
        latch = self.sigterm_latch  # type: ignore[attr-defined]
        if collectives.agree_to_stop(bool(latch and latch.should_act())):
            raise EvaluationAbandoned()

    def _run_pending_evaluation(self) -> None:
        """Resumed from a checkpoint whose evaluation was abandoned: evaluate before training on,
        where the uninterrupted run evaluated."""
        pending = self.state.preemptible.pop(PENDING_EVALUATION, None)  # type: ignore[attr-defined]
        if not pending or self.control.should_training_stop:  # type: ignore[attr-defined]
            return
        logger.info(
            "running the evaluation of step %d abandoned by the previous attempt",
            self.state.global_step,  # type: ignore[attr-defined]
        )
        self._evaluate_during_training(skip_scheduler=bool(pending.get("skip_scheduler")))
        if self.control.should_save:  # type: ignore[attr-defined]
            self.control.should_save = False  # type: ignore[attr-defined]
            self.save_checkpoint()  # type: ignore[attr-defined]

    def _checkpoint_rng_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The RNG state a checkpoint records: now, or the one from before a dropped step or an
        abandoned evaluation (so the resumed run replays it with the same random numbers)."""
        return self._rng_for_checkpoint or capture_rng_state()
