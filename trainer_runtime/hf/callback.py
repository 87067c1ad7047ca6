"""The operator contract for a stock ``transformers.Trainer`` (and subclasses such as TRL's).

``attach(trainer)`` (one line in the user's script, or done for them by
``python -m trainer_runtime.hf.run``) gives a transformers job what our own Trainer does:

- SIGTERM is latched (:class:`~trainer_runtime.signals.SigtermLatch`, ``kill_wait`` from the
  environment); at every optimizer-step boundary the ranks agree (an all-reduce of the stop flag)
  so a signal that reached one rank stops all of them at the same step;
- as our Trainer (``jit_stop.py``), it does not always wait for the step boundary: an evaluation or
  prediction inside train() is abandoned after its current batch (``on_prediction_step``; the
  training loop's evaluation runs again first after resume), a gradient-accumulation step that
  cannot fit the deadline is dropped at a micro-batch boundary (``on_substep_end``), and a JIT
  save that cannot finish before the deadline is not started (``deadline_too_short``);
- every checkpoint, periodic or JIT, is written by transformers' own ``_save_checkpoint`` inside our
  commit protocol: sentinel first (coordinator), every file fsynced, ``manifest.json`` written
  last, the sentinel removed last; transformers' rotation is deferred until after the commit and
  never removes the newest complete checkpoint;
- resume comes from ``$PREEMPTIBLE_RESUME_FROM`` (``latest``: the newest *complete* checkpoint),
  and ``resume_from_checkpoint=True`` means the newest complete one, never a half-written one;
- step and save wall times go to ``/metrics`` and to ``preemptible_state.json`` in each checkpoint
  (which ``trainer-runtime grace`` reads);
- after a JIT stop nothing of transformers' end of training runs (no best-model load, no
  ``save_total_limit=1`` cleanup that would delete the JIT checkpoint, no ``on_train_end``, no wait
  for a hub push): the callback raises :class:`JitStop` right after the commit, ``train()`` writes
  the termination message and exits with ``EXIT_PREEMPTED``.

transformers writes with ``os``/``open``, so an object-store output dir (``s3://...``, from
``$PREEMPTIBLE_OUTPUT_DIR`` or ``args.output_dir``) is served through a local scratch directory
(``$PREEMPTIBLE_SCRATCH_DIR``, e.g. an emptyDir): transformers saves there, then every file is
uploaded into the checkpoint on the store (multipart, checksummed on the way) inside the same
commit protocol, and the local copies are removed but the best checkpoint's; a resume downloads the
chosen checkpoint into the scratch directory first (parallel ranged reads, checksums checked), and
the best checkpoint next to it, so that ``best_model_checkpoint`` names a copy on this pod.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainer_runtime.checkpoint import fallback
from trainer_runtime.checkpoint.io import (
    CheckpointWriter,
    download_checkpoint,
    rotate_checkpoints,
)
from trainer_runtime.checkpoint.layout import (
    RUNTIME_STATE_NAME,
    CheckpointInfo,
    CheckpointStore,
    checkpoint_name,
    parse_step,
)
from trainer_runtime.checkpoint.per_node import gather_objects
from trainer_runtime.checkpoint.resume_choice import requested_resume, resolve_in_store
from trainer_runtime.checkpoint.rng import capture_rng_state, restore_rng_state
from trainer_runtime.checkpoint.shares import plan_shares
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.deadline import Action, exit_reserve, micro_batch_action, save_action
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import (
    CheckpointCorruptError,
    CheckpointError,
    ConfigurationError,
    ResumeError,
)
from trainer_runtime.hf.elastic import apply_elastic
from trainer_runtime.hf.stops import (
    EvaluationAbandoned,
    best_copy,
    deadline_message,
    stop_policy,
    superseded_copies,
)
from trainer_runtime.metrics import TrainingMetrics, metrics_from_env
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_OUTPUT_DIR,
    EXIT_PREEMPTED,
    REASON_DEADLINE_TOO_SHORT,
    writes_termination_message,
)
from trainer_runtime.signals import SigtermLatch
from trainer_runtime.timings import SaveTimer, StepTimer, timings_record, write_termination

__all__ = [
    "ENV_SCRATCH_DIR",
    "JitStop",
    "PreemptibleCallback",
    "adoption",
    "attach",
    "attach_preemptible",
    "resolve_resume",
    "scratch_dir",
    "upload_owners",
]

logger = logging.getLogger(__name__)

# Name in the manifest of who wrote the checkpoint's files (the manifest is still ours).
PRODUCER = "transformers.Trainer"
_ATTR = "_preemptible_callback"
# Key of the runtime record (preemptible_state.json) of a JIT checkpoint written in place of an
# evaluation of the training loop that was abandoned: the resumed run evaluates first.
PENDING_EVALUATION = "pending_evaluation"
# Where transformers writes a checkpoint before it is uploaded to an object-store output dir
# (give it an emptyDir; default: the system's temporary directory).
ENV_SCRATCH_DIR = "PREEMPTIBLE_SCRATCH_DIR"


def _under_operator() -> bool:
    return bool(os.environ.get(ENV_OUTPUT_DIR) or os.environ.get(ENV_ATTEMPT))


def _local_main() -> bool:
    # One termination message and one /metrics server per pod (torchrun starts several workers).
    try:
        return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0
    except ValueError:
        return True


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def scratch_dir(remote: str, base: str | None = None) -> str:
    """The local directory transformers writes into for the object-store output dir ``remote``;
    pure: ``<base>/<last part of the URL>-<hash of the URL>`` (``base``: $PREEMPTIBLE_SCRATCH_DIR,
    else the system's temporary directory)."""
    base = base or os.environ.get(ENV_SCRATCH_DIR) or tempfile.gettempdir()
    tail = remote.rstrip("/").rsplit("/", 1)[-1] or "output"
    digest = hashlib.sha256(remote.rstrip("/").encode()).hexdigest()[:10]
    return os.path.join(base, "preemptible-scratch", f"{tail}-{digest}")


def upload_owners(listings: list[tuple[str, list[str]]]) -> dict[str, int]:
    """Which rank uploads each file of a checkpoint transformers wrote into local scratch
    directories; pure. ``listings[rank] = (node, files that rank sees)``: ranks of one node share
    a scratch directory and see the same files. Each file is uploaded once, by the lowest rank
    that has it (a node's main process uploads its node's files)."""
    owners: dict[str, int] = {}
    for rank, (_, files) in enumerate(listings):
        for name in files:
            owners.setdefault(name, rank)
    return owners


def resolve_resume(resume: bool | str | None, output_dir: str) -> str | bool | None:
    """What to hand to ``transformers.Trainer.train(resume_from_checkpoint=...)``.

    ``None``: ``$PREEMPTIBLE_RESUME_FROM`` decides (``latest``: the newest complete checkpoint,
    or a fresh start when there is none; a path: that checkpoint, which must be complete).
    ``True``: the newest complete checkpoint (transformers would take the newest directory, even a
    half-written one). A path: checked complete. ``False``: no resume.
    """
    resume, from_env = requested_resume(resume)
    if resume is None or resume is False:
        return resume
    info = resolve_in_store(output_dir, resume, from_env=from_env)
    return info.path if info is not None else None


def _may_fall_back(resume: bool | str | None) -> bool:
    """Whether a corrupt checkpoint may give way to an older one: not for a path the caller
    passed to train() (``$PREEMPTIBLE_RESUME_FROM``, ``True`` and the operator's path may)."""
    return resume is None or resume is True


def adoption(
    listing: dict[str, int], rank: int, world_size: int, *, jit: bool
) -> tuple[dict[str, int], bool]:
    """Pure: which of the files transformers wrote (path -> size) ``rank`` records in the
    manifest, and whether it hashes them. A JIT save: rank 0 records every file, sizes only. A
    periodic save: every file is hashed by exactly one rank, the ranks sharing the bytes."""
    if jit:
        return (dict(listing) if rank == 0 else {}), False
    shares, _ = plan_shares(sorted(listing.items()), world_size)
    return {name: listing[name] for name in shares[rank]}, True


class JitStop(SystemExit):
    """Raised by the callback on every rank right after the JIT checkpoint is committed (and the
    termination message written): it unwinds transformers' ``train()`` past its end of training.
    ``_finalize_training`` would load the best model (minutes for a large one, past the grace),
    delete every checkpoint but the best one under ``save_total_limit=1`` (the JIT checkpoint
    included), run ``on_train_end`` (trackers may upload the model there) and wait for a hub
    push. The wrapped ``train()`` catches it and exits with ``EXIT_PREEMPTED``. A ``SystemExit``
    (code 75) so that nothing on the way catches it as an error (``except Exception``, accelerate's
    batch-size finder) and, should it escape, the process still ends with 75."""

    def __init__(self, step: int) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.step = step


@dataclass
class _StepSnapshot:
    """What a step dropped at a micro-batch boundary puts back: the state when it began."""

    rng: Any
    current_flos: float
    num_input_tokens_seen: int


class SaveFailedOnARank(CheckpointError):
    """A part of a save failed on some rank; raised on every rank at the same agreement point
    (so no rank waits for the others in a barrier), naming the failing ranks."""


def _agree_on(error: Exception | None, what: str, path: str) -> None:
    """Every rank calls this after its part of ``what``, failed or not (``error``): an
    all-gather of each rank's outcome. A failure on any rank raises :class:`SaveFailedOnARank`
    on every rank, naming the rank(s) and their errors; in one process the error itself."""
    if not collectives.is_distributed():
        if error is not None:
            raise error
        return
    kind = fallback.OK if error is None else fallback.ERROR
    message = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = fallback.gather_outcomes(kind, message)
    if fallback.verdict(outcomes) == fallback.OK:
        return
    raise SaveFailedOnARank(
        f"{what} of {path} failed on {fallback.describe(outcomes, fallback.ERROR)}"
    ) from error


@contextlib.contextmanager
def _no_hub_push(trainer: Any, jit: bool) -> Iterator[None]:
    """A JIT save does not push to the Hub (``push_to_hub``: transformers would copy the weights
    into the output dir and start an upload that the exit right after the commit cuts off)."""
    push = getattr(trainer.args, "push_to_hub", False)
    if not (jit and push):
        yield
        return
    trainer.args.push_to_hub = False
    try:
        yield
    finally:
        trainer.args.push_to_hub = push


def _flush_trackers(trainer: Any) -> None:
    """The cheap part of ``on_train_end`` after a JIT stop: flush TensorBoard's event files
    (wandb, mlflow and others flush from their own exit handlers; their ``on_train_end`` may
    upload the model, which a preempted attempt must not do)."""
    for cb in trainer.callback_handler.callbacks:
        writer = getattr(cb, "tb_writer", None)
        flush = getattr(writer, "flush", None)
        if callable(flush):
            try:
                flush()
            except Exception as exc:  # a tracker never blocks the exit
                logger.warning("cannot flush %s: %s", type(cb).__name__, exc)


class PreemptibleCallback(TrainerCallback):
    """The callback half of the integration; create it with :func:`attach`, which also wraps
    ``trainer.train`` (resume, exit code) and ``trainer._save_checkpoint`` (the commit)."""

    def __init__(self, *, exit_on_preemption: bool = True) -> None:
        self.trainer: Any = None
        self.exit_on_preemption = exit_on_preemption
        self.latch = SigtermLatch()
        self.step_timer = StepTimer()
        self.save_timer = SaveTimer()
        self.micro_batch_timer = StepTimer()
        self.sigterm_to_exit: list[float] = []
        self.metrics: TrainingMetrics | None = None
        self.preempted = False
        self.last_checkpoint: CheckpointInfo | None = None
        self._step_started: float | None = None
        # an object-store output dir: transformers writes into ``scratch``, we upload (attach)
        self.remote: str | None = None
        self.scratch: str | None = None
        # how the JIT stop happened (termination message ``stop``), and why no save (no_save)
        self.stop_kind: str | None = None
        self._deadline_message: str | None = None
        # inside the wrapped train() / evaluate() (the stops only act there)
        self._in_train = False
        self._eval_depth = 0
        # the training loop's evaluation in progress ({"skip_scheduler": ...}), the one to run
        # again after resume (read from the resumed checkpoint), train()'s ignore_keys_for_eval
        self._loop_eval: dict[str, Any] | None = None
        self._pending_eval: dict[str, Any] | None = None
        self._pending_record: dict[str, Any] | None = None
        self._ignore_keys: Any = None
        self._resumed_local: str | None = None
        # micro-batch stops: the state when the step began (what a dropped step puts back)
        self._snapshot: _StepSnapshot | None = None
        self._boundary_rng: Any = None
        self._micro_started: float | None = None
        self._micro_done = 0

    # -- events ------------------------------------------------------------------------------------
    def _require_trainer(self) -> Any:
        if self.trainer is None:
            raise ConfigurationError(
                "PreemptibleCallback was added without its Trainer: use "
                "`trainer_runtime.hf.attach(trainer)` instead of callbacks=[PreemptibleCallback()]"
            )
        return self.trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._require_trainer()
        self._publish(state)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Before the epoch's DataLoader iterator exists (it draws from the global RNG): the RNG
        # a step dropped at the start of this epoch puts back (the periodic save of the step
        # before holds this state too).
        self._boundary_rng = capture_rng_state() if self._micro_batch_stops(args) else None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        now = time.monotonic()
        if self._step_started is None:
            self._step_started = now
        self._micro_started, self._micro_done = now, 0
        self._snapshot = None
        if not self._micro_batch_stops(args):
            return
        trainer = self._require_trainer()
        # The step's micro-batches are fetched already; fetching draws no random numbers (the
        # sampler drew the epoch's order when the iterator was made), so the RNG now is the one
        # after the previous step, except at an epoch's first step (taken at on_epoch_begin).
        rng = self._boundary_rng if self._boundary_rng is not None else capture_rng_state()
        self._boundary_rng = None
        self._snapshot = _StepSnapshot(
            rng=rng,
            current_flos=float(getattr(trainer, "current_flos", 0.0)),
            num_input_tokens_seen=state.num_input_tokens_seen,
        )

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After each micro-batch of a gradient-accumulation step but its last: every rank
        agrees whether to drop the partial accumulation and save the last completed step now
        (``deadline.micro_batch_action``: always under ``micro_batch``, under ``finish_step``
        when the rest of the step and the save would miss the deadline)."""
        now = time.monotonic()
        if self._micro_started is not None:
            self.micro_batch_timer.record(now - self._micro_started)
        self._micro_started = now
        self._micro_done += 1
        snapshot = self._snapshot
        if snapshot is None or self.preempted or not self._in_train:
            return
        trainer = self._require_trainer()
        per_step = getattr(trainer, "current_gradient_accumulation_steps", None)
        left = int(per_step or args.gradient_accumulation_steps) - self._micro_done
        action = micro_batch_action(
            policy=stop_policy(args),
            acting=self.latch.should_act(),
            seconds_left=self.latch.seconds_left(),
            micro_batches_left=left,
            micro_batch_seconds=self.micro_batch_timer.max,
            save_seconds=self.save_timer.jit_estimate,
            exit_seconds=exit_reserve(None),
        )
        if collectives.agree_max(int(action)) < Action.DROP_STEP:
            return
        # Weights, optimizer and scheduler have not moved since the last completed step: put
        # back what the dropped micro-batches changed; they are trained again after resume
        # (transformers skips batches by global_step), with the same random numbers.
        trainer.current_flos = snapshot.current_flos
        state.num_input_tokens_seen = snapshot.num_input_tokens_seen
        model = getattr(trainer, "model", None)
        if model is not None:
            model.zero_grad(set_to_none=True)  # the checkpoint never holds them anyway
        logger.warning(
            "SIGTERM: dropping the partial gradient accumulation of step %d (%d micro-batches, "
            "trained again after resume): saving step %d now",
            state.global_step + 1,
            self._micro_done,
            state.global_step,
        )
        self._jit_stop(state, "micro_batch", rng=snapshot.rng)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._micro_started is not None and self._micro_done:
            # the step's last micro-batch (no on_substep_end for it), before the optimizer step
            self.micro_batch_timer.record(time.monotonic() - self._micro_started)
        self._micro_started = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._step_started is not None:
            self.step_timer.record(time.monotonic() - self._step_started)
            self._step_started = None
        self._snapshot = None
        self._micro_started = None
        # Every rank takes part in the collective at every step boundary, signalled or not: this
        # is what stops all ranks at the same step when SIGTERM reached only one.
        stop = collectives.agree_to_stop(self.latch.should_act())
        self._publish(state)
        if not stop or self.preempted:
            return
        if 0 < state.max_steps <= state.global_step:
            return  # the last step: training is finished, not interrupted
        control.should_training_stop = True
        control.should_save = False  # the JIT save below is the save of this step
        control.should_evaluate = False
        logger.warning("SIGTERM: stopping at step %d for a JIT checkpoint", state.global_step)
        self._jit_stop(state, "step")

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After each batch of an evaluation or prediction inside train(): every rank agrees
        whether to abandon it (transformers' loop has no stop; the wrapper around
        ``evaluate``/``predict`` catches :class:`EvaluationAbandoned`)."""
        if not self._in_train or self._eval_depth == 0 or self.preempted:
            return
        if collectives.agree_to_stop(self.latch.should_act()):
            raise EvaluationAbandoned()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.preempted:  # no second (epoch) save or evaluation after the JIT checkpoint
            control.should_save = False
            control.should_evaluate = False

    # -- the JIT stops -----------------------------------------------------------------------------
    def _micro_batch_stops(self, args: Any) -> bool:
        """Whether this run decides at micro-batch boundaries: inside train(), with gradient
        accumulation."""
        return self._in_train and int(getattr(args, "gradient_accumulation_steps", 1) or 1) > 1

    def _save_fits(self, state: Any) -> bool:
        """All ranks agree whether the JIT save can finish before the deadline (the longest of
        the recent saves, earlier attempts included). A step already saved always fits."""
        last = self.last_checkpoint
        if last is not None and last.step == state.global_step:
            return True
        # transformers' post-commit work (rotation, on_save) is not measured here: the exit
        # reserve's unmeasured floor is kept back, as our Trainer does before its first save
        action = save_action(
            seconds_left=self.latch.seconds_left(),
            save_seconds=self.save_timer.jit_estimate,
            exit_seconds=exit_reserve(None),
        )
        return collectives.agree_max(int(action)) < Action.SKIP_SAVE

    def _jit_stop(
        self,
        state: Any,
        kind: str,
        *,
        rng: Any = None,
        pending: dict[str, Any] | None = None,
    ) -> None:
        """Save the JIT checkpoint of ``state.global_step`` (unless it cannot finish before the
        deadline), write the termination message and leave train() (:class:`JitStop`).
        ``rng``: the RNG state the checkpoint records instead of the current one (before a
        dropped step or an abandoned evaluation); ``pending``: the abandoned evaluation of the
        training loop, run again after resume."""
        trainer = self._require_trainer()
        self.preempted = True
        self.stop_kind = kind
        if not self._save_fits(state):
            # A save SIGKILLed half-way is worth nothing, and it would cost the newest
            # complete checkpoint nothing to keep it: write nothing, exit now.
            self.stop_kind = "no_save"
            self._deadline_message = deadline_message(
                save_seconds=self.save_timer.jit_estimate,
                seconds_left=self.latch.seconds_left(),
                grace_seconds=self.latch.grace_seconds,
                node_notice_seconds=self.latch.node_notice_seconds,
                step=int(state.global_step),
                last_complete=self.last_checkpoint.step if self.last_checkpoint else None,
            )
            logger.error("DEADLINE TOO SHORT: %s", self._deadline_message)
            self._terminate(
                REASON_DEADLINE_TOO_SHORT,
                message=self._deadline_message,
                sigterm_to_exit=self.latch.elapsed(),
                no_checkpoint=True,
            )
            _flush_trackers(trainer)
            raise JitStop(int(state.global_step))
        if rng is not None:
            restore_rng_state(*rng)  # transformers' _save_rng_state writes the current state
        self._pending_record = pending
        trainer._save_checkpoint(trainer.model, trial=None)
        # Committed on every rank (the commit ends with a barrier). Nothing of transformers' end
        # of training may run now: leave train() (see JitStop); the wrapper exits with 75.
        self._terminate("preempted", sigterm_to_exit=self.latch.elapsed())
        _flush_trackers(trainer)
        raise JitStop(int(state.global_step))

    def abandonable(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        """``evaluate`` / ``predict`` inside train(): a SIGTERM abandons it after the current
        batch (every rank agreeing) and the JIT checkpoint of the completed step is written with
        the RNG state from before the evaluation (it draws random numbers: the DataLoader's
        seed), so that the evaluation run again after resume draws the same ones."""
        if not self._in_train or self.preempted:
            return original(*a, **kw)
        rng = capture_rng_state()
        pending = self._loop_eval
        self._eval_depth += 1
        try:
            return original(*a, **kw)
        except EvaluationAbandoned:
            trainer = self._require_trainer()
            control = trainer.control
            control.should_save = control.should_evaluate = False
            control.should_training_stop = True
            logger.warning(
                "SIGTERM: evaluation at step %d abandoned for the JIT checkpoint%s",
                trainer.state.global_step,
                "; it runs again after resume" if pending is not None else "",
            )
            self._jit_stop(trainer.state, "evaluation", rng=rng, pending=pending)
            raise  # (not reached: _jit_stop raises JitStop)
        finally:
            self._eval_depth -= 1

    def loop_evaluation(self, original: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        """transformers' ``_evaluate`` (the training loop's evaluation): marks the evaluation
        as the loop's, so an abandoned one is run again after resume."""
        skip = kw.get("skip_scheduler", a[2] if len(a) > 2 else False)
        previous = self._loop_eval
        self._loop_eval = {"skip_scheduler": bool(skip)}
        try:
            return original(*a, **kw)
        finally:
            self._loop_eval = previous

    def rng_loaded(self, original: Callable[..., Any], checkpoint: Any, *a: Any, **kw: Any) -> Any:
        """transformers' ``_load_rng_state`` on resume: the checkpoint's RNG state is current
        from here on. An evaluation the previous attempt abandoned runs now, where the
        uninterrupted run ran it (after the step, before the next one draws)."""
        result = original(checkpoint, *a, **kw)
        trainer = self._require_trainer()
        pending, self._pending_eval = self._pending_eval, None
        if pending is not None and checkpoint is not None:
            self._run_pending_evaluation(pending)
        if self._micro_batch_stops(trainer.args):
            self._boundary_rng = capture_rng_state()  # (taken at on_epoch_begin before the load)
        return result

    def _run_pending_evaluation(self, pending: dict[str, Any]) -> None:
        trainer = self._require_trainer()
        state = trainer.state
        logger.info(
            "running the evaluation of step %d abandoned by the previous attempt", state.global_step
        )
        metrics = trainer._evaluate(
            None, self._ignore_keys, skip_scheduler=bool(pending.get("skip_scheduler"))
        )
        trainer._determine_best_metric(metrics=metrics, trial=None)
        # The uninterrupted run saved this step right after it: the best one is then its
        # checkpoint, which is the one resumed from.
        local = self._resumed_local
        if state.best_global_step == state.global_step and local and os.path.isdir(local):
            state.best_model_checkpoint = local

    # -- metrics -----------------------------------------------------------------------------------
    def _publish(self, state: Any) -> None:
        if self.metrics is None:
            return
        self.metrics.update(
            step=state.global_step,
            max_steps=state.max_steps,
            epoch=state.epoch,
            step_seconds=self.step_timer.to_model(),
            save_seconds=self.save_timer.to_model(),
            last_complete_checkpoint_step=self.last_checkpoint.step
            if self.last_checkpoint
            else None,
            stop_requested=self.latch.triggered,
        )

    # -- the committed save ------------------------------------------------------------------------
    def _record(self, jit: bool) -> dict[str, Any]:
        elapsed = self.latch.elapsed() if jit else None
        record = {
            "producer": PRODUCER,
            **timings_record(
                self.step_timer,
                self.save_timer,
                self.sigterm_to_exit,
                jit_elapsed=elapsed,
                micro_batch_timer=self.micro_batch_timer,
            ),
        }
        if jit and self._pending_record is not None:
            record[PENDING_EVALUATION] = dict(self._pending_record)
        return record

    def committed_save(
        self, original: Callable[..., Any], model: Any, trial: Any, *a: Any, **kw: Any
    ) -> Any:
        """Run transformers' ``_save_checkpoint`` between our sentinel and our manifest."""
        trainer = self._require_trainer()
        step = int(trainer.state.global_step)
        if self.last_checkpoint is not None and self.last_checkpoint.step == step:
            return None  # this step is already committed (e.g. an epoch save after a JIT one)
        if self.remote is not None:
            return self._committed_upload(original, model, trial, *a, **kw)
        run_dir = str(trainer._get_output_dir(trial=trial))
        writer = CheckpointWriter(
            run_dir,
            step,
            rank=collectives.rank(),
            world_size=collectives.world_size(),
            barrier=collectives.barrier,
        )
        started = time.monotonic()
        limit = trainer.args.save_total_limit
        result: Any = None
        try:
            writer.begin()  # coordinator: fence, sentinel (fsynced); barrier
            # Each part below ends in an agreement that every rank reaches, its own part failed
            # or not: a failure on one rank fails all of them there, promptly and named, instead
            # of leaving the others in a barrier until the collective timeout.
            error: Exception | None = None
            # transformers rotates inside _save_checkpoint, before our commit: it could delete
            # the newest complete checkpoint while the new one is still incomplete. Rotate after.
            trainer.args.save_total_limit = None
            try:
                with _no_hub_push(trainer, self.preempted):
                    result = original(model, trial, *a, **kw)
            except Exception as exc:
                error = exc
            finally:
                trainer.args.save_total_limit = limit
            _agree_on(error, "transformers' save", writer.path)  # every rank finished writing
            try:
                writer.sync_present()  # each rank flushes what it (or transformers for it) wrote
            except Exception as exc:
                error = exc
            _agree_on(error, "the fsync", writer.path)
            try:
                self._adopt(writer)
                if writer.is_coordinator:
                    writer.write_json(RUNTIME_STATE_NAME, self._record(self.preempted))
            except Exception as exc:
                error = exc
            _agree_on(error, "the listing", writer.path)
            extra: dict[str, Any] = {"producer": PRODUCER}
            if self.preempted:
                extra["checksums"] = "sizes only: JIT save of transformers.Trainer"
            info = writer.commit(extra)  # manifest last, sentinel removed last
        except Exception as exc:
            # e.g. ENOSPC: the partial directory would keep holding the space (one process:
            # the whole directory; several: what this rank wrote through the writer, or the
            # whole directory when every rank is known to be done with it)
            writer.discard(every_rank_done=isinstance(exc, SaveFailedOnARank))
            raise
        self.save_timer.record(time.monotonic() - started)
        self.last_checkpoint = info
        if limit and writer.is_coordinator:
            best = trainer.state.best_model_checkpoint
            rotate_checkpoints(run_dir, limit, protect=[best] if best else ())
        collectives.barrier()
        self._publish(trainer.state)
        logger.info("checkpoint %s committed (%.3f s)", info.path, self.save_timer.last or 0.0)
        return result

    def _remote_of(self, local: str) -> str:
        """The object-store URL of a path under the scratch directory."""
        assert self.remote is not None and self.scratch is not None
        rel = os.path.relpath(local, self.scratch)
        return self.remote if rel == "." else f"{self.remote.rstrip('/')}/{rel}"

    def _committed_upload(
        self, original: Callable[..., Any], model: Any, trial: Any, *a: Any, **kw: Any
    ) -> Any:
        """An object-store output dir: our sentinel on the store, transformers' own save into
        the scratch directory, each file uploaded (checksummed as it goes up) by one rank,
        our manifest last; then the local copy goes."""
        trainer = self._require_trainer()
        step = int(trainer.state.global_step)
        local_run = str(trainer._get_output_dir(trial=trial))
        remote_run = self._remote_of(local_run)
        writer = CheckpointWriter(
            remote_run,
            step,
            rank=collectives.rank(),
            world_size=collectives.world_size(),
            barrier=collectives.barrier,
        )
        started = time.monotonic()
        limit = trainer.args.save_total_limit
        local_ckpt = Path(local_run) / checkpoint_name(step)
        result: Any = None
        try:
            writer.begin()  # coordinator: fence, sentinel on the store; barrier
            error: Exception | None = None  # each part ends in an agreement (committed_save)
            trainer.args.save_total_limit = None  # as in committed_save: rotate after the commit
            try:
                with _no_hub_push(trainer, self.preempted):
                    result = original(model, trial, *a, **kw)
            except Exception as exc:
                error = exc
            finally:
                trainer.args.save_total_limit = limit
            # every rank's files are in its node's scratch directory
            _agree_on(error, "transformers' save", writer.path)
            mine: list[str] = []
            try:
                mine = sorted(
                    str(p.relative_to(local_ckpt)) for p in local_ckpt.rglob("*") if p.is_file()
                )
            except Exception as exc:
                error = exc
            listings = [(os.uname().nodename, mine)]
            if writer.world_size > 1:
                listings = gather_objects(listings[0])
            _agree_on(error, "the listing", writer.path)
            owners = upload_owners(listings)
            uploading = time.monotonic()
            try:
                names = writer.upload_local_files(
                    {n: str(local_ckpt / n) for n, r in owners.items() if r == writer.rank}
                )
                logger.info(
                    "uploaded %d file(s) of %s in %.2f s",
                    len(names),
                    writer.path,
                    time.monotonic() - uploading,
                )
                if writer.is_coordinator:
                    writer.write_json(RUNTIME_STATE_NAME, self._record(self.preempted))
            except Exception as exc:
                error = exc
            _agree_on(error, "the upload", writer.path)
            info = writer.commit({"producer": PRODUCER})  # manifest last (conditional on S3)
        except Exception as exc:
            # what reached the store (all of it when every rank is known to be done)
            writer.discard(every_rank_done=isinstance(exc, SaveFailedOnARank))
            if _local_main():
                shutil.rmtree(local_ckpt, ignore_errors=True)  # and the scratch copy
            raise
        self.save_timer.record(time.monotonic() - started)
        self.last_checkpoint = info
        best = trainer.state.best_model_checkpoint
        if limit and writer.is_coordinator:
            protect = [self._remote_of(best)] if best else []
            rotate_checkpoints(remote_run, limit, protect=protect)
        collectives.barrier()
        if _local_main():
            self._sweep_scratch(local_run, best)
        self._publish(trainer.state)
        logger.info("checkpoint %s committed (%.3f s)", info.path, self.save_timer.last or 0.0)
        return result

    @staticmethod
    def _sweep_scratch(local_run: str, best: str | None) -> None:
        """The store has every committed checkpoint: the scratch directory keeps only the copy
        of the best one (``load_best_model_at_end`` loads it from there, transformers' save
        checks it exists). A best checkpoint superseded by a newer best, the checkpoint just
        committed and the copy a resume downloaded all go (an emptyDir must not fill up)."""
        keep = None
        if best and os.path.dirname(os.path.abspath(best)) == os.path.abspath(local_run):
            keep = os.path.basename(best.rstrip("/"))
        try:
            names = os.listdir(local_run)
        except OSError:
            return
        for name in superseded_copies(names, keep):
            path = os.path.join(local_run, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)

    def _adopt(self, writer: CheckpointWriter) -> None:
        """List what transformers wrote in the manifest. A JIT save records sizes only: reading
        the checkpoint back to hash it (about 98 GB at 7B with fp32 Adam state) would take much
        of the grace period, and a reader checks sizes. A periodic save hashes every file, each
        rank a share of them by bytes (shares.plan_shares), read back while they are likely
        still in the page cache; the coordinator's listing is the one every rank splits."""
        listing: dict[str, int] | None = None
        error: Exception | None = None
        if writer.is_coordinator:
            try:
                listing = writer.present_files()
            except Exception as exc:  # the others wait in the gather: reach it, then raise
                error = exc
        if writer.world_size > 1:
            listing = gather_objects(listing)[0]
        if error is not None:
            raise error
        if listing is None:
            raise CheckpointError(f"rank 0 could not list {writer.path}; see its error")
        files, checksum = adoption(listing, writer.rank, writer.world_size, jit=self.preempted)
        writer.adopt(files, checksum=checksum)

    # -- train -------------------------------------------------------------------------------------
    def wrapped_train(
        self, original: Callable[..., Any], resume_from_checkpoint: Any = None, *a: Any, **kw: Any
    ) -> Any:
        self._require_trainer()
        operator = _under_operator()
        self._ignore_keys = kw.get("ignore_keys_for_eval")
        self._pending_eval = None
        self._resumed_local = None
        try:
            # an elastic attempt keeps the global batch at the size it got, or is refused here
            apply_elastic(self._require_trainer())
            resolved = self._resolve(resume_from_checkpoint)
        except BaseException as exc:
            # an elastic size or data shape that cannot keep the global batch, a bad output dir
            # (scheme, bucket, credentials) or checkpoint: the attempt fails before training,
            # with the reason in the termination message
            if operator and not isinstance(exc, SystemExit | KeyboardInterrupt):
                self._terminate("failed", message=f"{type(exc).__name__}: {exc}")
            raise
        if isinstance(resolved, str):
            self._resumed_local = resolved
            self._load_timings(resolved)
        if self.latch.triggered:
            self.latch = SigtermLatch()  # a SIGTERM that stopped an earlier train() is spent
        self.latch.install()
        if self.metrics is None and _local_main():
            self.metrics = metrics_from_env()
        self.preempted = False
        self.stop_kind = self._deadline_message = None
        self._pending_record = None
        keep_handler = False
        self._in_train = True
        try:
            try:
                output = original(resolved, *a, **kw)
            except JitStop as stop:
                # the JIT checkpoint is committed (or, deadline too short, none started) and the
                # termination message written (the callback); transformers' end of training was
                # skipped on purpose
                keep_handler = True  # a second SIGTERM must not turn exit 75 into death by signal
                if self.exit_on_preemption:
                    written = self.last_checkpoint.path if self.last_checkpoint else None
                    logger.warning(
                        "preempted: %s, exiting with %d",
                        "no checkpoint written (deadline too short)"
                        if self.stop_kind == "no_save"
                        else f"checkpoint {written} written",
                        EXIT_PREEMPTED,
                    )
                    collectives.exit_process(EXIT_PREEMPTED)
                return self._preempted_output(stop.step)
            if operator:
                keep_handler = True
                self._terminate("completed")
            return output
        except BaseException as exc:
            if operator and not isinstance(exc, SystemExit | KeyboardInterrupt):
                self._terminate("failed", message=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._in_train = False
            if not keep_handler:
                self.latch.uninstall()

    def _preempted_output(self, step: int) -> Any:
        """What ``train()`` returns after a JIT stop with ``exit_on_preemption=False``: the
        step, no loss or metrics (transformers computes them in the end of training, skipped)."""
        from transformers.trainer_utils import TrainOutput

        trainer = self._require_trainer()
        trainer.is_in_train = False
        handle = getattr(trainer, "neftune_hook_handle", None)
        if getattr(trainer, "neftune_noise_alpha", None) is not None and handle is not None:
            from transformers.integrations.neftune import deactivate_neftune

            # as _finalize_training does, so that what follows runs without the noise
            deactivate_neftune(trainer.model, handle, trainer.accelerator)
        return TrainOutput(step, float("nan"), {})

    def _resolve(self, resume: Any) -> str | bool | None:
        """Check the output dir, then resolve the checkpoint to resume from; on an object store
        the chosen one is downloaded into the scratch directory (by each node's main process)
        and its local path is what transformers gets."""
        trainer = self._require_trainer()
        output = self.remote or str(trainer.args.output_dir)
        Storage(output).check_access(write=_local_main())
        resolved = resolve_resume(resume, output)
        self.last_checkpoint = None  # (of an earlier train() call)
        if isinstance(resolved, str):
            # The state at this step is the checkpoint's: a save of the same step (an epoch or
            # final save right after the resume) is skipped instead of rewriting it, which would
            # delete the complete checkpoint before its replacement is complete.
            self.last_checkpoint = CheckpointStore(output).inspect(resolved)
        if self.remote is None or not isinstance(resolved, str):
            return resolved
        while True:
            local = os.path.join(
                str(trainer.args.output_dir), resolved.rstrip("/").rsplit("/", 1)[-1]
            )
            error: Exception | None = None
            if _local_main():
                try:
                    # every file's checksum checked as it arrives: CheckpointCorruptError
                    self._download(resolved, local)
                except Exception as exc:
                    error = exc
                else:
                    self._restore_best(local)
            # every node's download agreed on (this also waits for every node's copy)
            kind, message = fallback.outcome_of(error)
            agreed, outcomes = fallback.settle(kind, message, resolved)
            if agreed == fallback.OK:
                return local
            if agreed == fallback.ERROR:
                if error is not None:
                    raise error
                raise ResumeError(
                    f"cannot resume from {resolved}: {fallback.describe(outcomes, fallback.ERROR)}"
                )
            older = self._fall_back(resume, resolved, output, outcomes)
            if older is None:
                self.last_checkpoint = None
                return None  # transformers has loaded nothing yet: a fresh start is clean
            resolved = older.path
            self.last_checkpoint = older

    def _restore_best(self, local: str) -> None:
        """After a resume from the store: ``best_model_checkpoint`` in the downloaded
        ``trainer_state.json`` is a scratch path of the pod that saved it, which does not exist
        here (transformers would drop it: ``load_best_model_at_end`` would then silently load
        nothing, and our rotation would not protect the best checkpoint on the store). Download
        the best checkpoint next to the resumed one (unless it is the resumed one) and point the
        state at that copy, as a local output dir would have it. Best effort: a best checkpoint
        that is gone from the store or fails its download is dropped, as transformers drops it."""
        path = os.path.join(local, "trainer_state.json")
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            return
        plan = best_copy(doc.get("best_model_checkpoint") if isinstance(doc, dict) else None, local)
        if plan is None:
            return
        name, target = plan
        if os.path.abspath(target) != os.path.abspath(local):
            remote = self._remote_of(target)
            try:
                info = CheckpointStore(self._remote_of(os.path.dirname(target))).inspect(name)
                if not info.complete:
                    raise ResumeError(f"{remote} is not complete")
                self._download(remote, target)
            except Exception as exc:  # best effort: transformers drops a best that is not there
                logger.warning(
                    "best checkpoint %s not restored (%s): load_best_model_at_end will not load it",
                    remote,
                    exc,
                )
                shutil.rmtree(target, ignore_errors=True)
                return
        if doc["best_model_checkpoint"] != target:
            doc["best_model_checkpoint"] = target
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2, sort_keys=True)
                f.write("\n")
            os.replace(tmp, path)
        logger.info("best checkpoint %s restored at %s", name, target)

    def _download(self, remote: str, local: str) -> None:
        started = time.monotonic()
        shutil.rmtree(local, ignore_errors=True)
        names = download_checkpoint(remote, local)
        logger.info(
            "downloaded %s (%d files) to %s in %.2f s",
            remote,
            len(names),
            local,
            time.monotonic() - started,
        )

    def _fall_back(
        self, resume: Any, path: str, output: str, outcomes: list[fallback.Outcome]
    ) -> CheckpointInfo | None:
        """``path`` is corrupt (fallback.py): mark it (rank 0), then the newest complete
        checkpoint before it, the same on every rank; None: start fresh. CheckpointCorruptError
        for a path the caller passed, or with nothing left under resume_from_checkpoint=True."""
        cause = fallback.describe(outcomes, fallback.CORRUPT)
        marker = fallback.mark(path, cause) if collectives.rank() == 0 else None
        logger.error(
            "checkpoint %s is corrupt: %s; marked corrupt%s, it is never resumed from again",
            path,
            cause,
            f" ({marker})" if marker else "",
        )
        if not _may_fall_back(resume):
            raise CheckpointCorruptError(
                f"cannot resume from {path}: it is corrupt ({cause}); it was asked for by path, "
                "so no other checkpoint is substituted: pass an earlier checkpoint, or "
                "resume_from_checkpoint=True for the newest complete one"
            )
        step = parse_step(path)
        older = CheckpointStore(output).latest_complete(below=-1 if step is None else step)
        agreed = fallback.agree_step(older.step if older is not None else None)
        if agreed is not None and older is not None:
            logger.error("falling back to %s (step %d)", older.path, older.step)
            return older
        if resume is True:
            raise CheckpointCorruptError(
                f"resume_from_checkpoint=True but {path} is corrupt ({cause}) and no complete "
                "checkpoint precedes it"
            )
        logger.error("no complete checkpoint precedes %s: starting from scratch", path)
        return None

    def _load_timings(self, path: str) -> None:
        """Carry step/save measurements over from the checkpoint we resume from."""
        store = CheckpointStore(path)
        if not store.storage.exists(RUNTIME_STATE_NAME):
            return
        try:
            record = store.storage.read_json(RUNTIME_STATE_NAME)
        except Exception as exc:  # measurements are advisory; never block a resume on them
            logger.warning("cannot read %s/%s: %s", path, RUNTIME_STATE_NAME, exc)
            return
        if isinstance(record, dict):
            self.step_timer.load(record.get("step_seconds"))
            self.save_timer.load(record.get("save_seconds"))
            self.sigterm_to_exit = [float(x) for x in record.get("sigterm_to_exit_seconds") or []]
            self.micro_batch_timer.load(record.get("micro_batch_seconds"))
            pending = record.get(PENDING_EVALUATION)
            self._pending_eval = dict(pending) if isinstance(pending, dict) else None

    def _terminate(
        self,
        reason: str,
        *,
        message: str | None = None,
        sigterm_to_exit: float | None = None,
        no_checkpoint: bool = False,
    ) -> None:
        # One message per pod (local rank 0), or one per worker under `trainer-runtime launch`,
        # which merges them.
        if not writes_termination_message():
            return
        write_termination(
            reason,
            step=self.trainer.state.global_step,
            # deadline too short: nothing was written, the message names no checkpoint
            checkpoint=None if no_checkpoint else self.last_checkpoint,
            step_timer=self.step_timer,
            save_timer=self.save_timer,
            sigterm_to_exit=sigterm_to_exit,
            message=message,
            micro_batch_timer=self.micro_batch_timer,
            stop=self.stop_kind if self.preempted else None,
        )


def _drop_jit_callback(trainer: Any) -> None:
    """transformers' own JIT callback (enable_jit_checkpoint=True) would race ours for SIGTERM and
    write uncommitted checkpoints: restore the handler it replaced and remove it."""
    for cb in list(trainer.callback_handler.callbacks):
        if type(cb).__name__ != "JITCheckpointCallback":
            continue
        manager = getattr(cb, "jit_manager", None)
        previous = getattr(manager, "_original_sigterm_handler", None)
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)
        trainer.callback_handler.remove_callback(cb)
        logger.info(
            "enable_jit_checkpoint: transformers' JIT callback replaced by the preemptible one"
        )


def _apply_output_dir(trainer: Any, callback: PreemptibleCallback) -> None:
    """``$PREEMPTIBLE_OUTPUT_DIR`` is where the operator looks for checkpoints: it wins. An
    object-store URL (there or in ``args.output_dir``) becomes the callback's ``remote`` and
    transformers writes into a local scratch directory instead (see the module docstring)."""
    env = os.environ.get(ENV_OUTPUT_DIR, "").strip()
    target = env or str(trainer.args.output_dir)
    if not _is_local(target):
        callback.remote = target.rstrip("/")
        callback.scratch = scratch_dir(callback.remote)
        os.makedirs(callback.scratch, exist_ok=True)
        logger.info(
            "output dir %s: transformers writes into %s, each checkpoint is uploaded from there",
            callback.remote,
            callback.scratch,
        )
        trainer.args.output_dir = callback.scratch
        return
    if not env:
        return
    path = env[len("file://") :] if env.startswith("file://") else env
    if os.path.abspath(str(trainer.args.output_dir)) != os.path.abspath(path):
        logger.warning(
            "output_dir %s replaced by %s=%s (where the operator reads checkpoints)",
            trainer.args.output_dir,
            ENV_OUTPUT_DIR,
            path,
        )
        trainer.args.output_dir = path


def _wrap(trainer: Any, name: str, through: Callable[..., Any]) -> None:
    """Replace ``trainer.<name>`` on this instance by ``through(original, *args, **kwargs)``."""
    original = getattr(trainer, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def wrapper(*a: Any, **kw: Any) -> Any:
        return through(original, *a, **kw)

    setattr(trainer, name, wrapper)


def _wrap_evaluation(trainer: Any, callback: PreemptibleCallback) -> None:
    """The evaluation stops: ``evaluate`` / ``predict`` catch an abandoned loop (transformers'
    loop has no stop; ``on_prediction_step`` raises), ``_evaluate`` marks the training loop's
    evaluation (run again after resume when abandoned), ``_load_rng_state`` runs that
    evaluation where the uninterrupted run ran it. The last two are transformers' private
    methods (5.x): without them an abandoned evaluation is not run again after resume."""
    _wrap(trainer, "evaluate", callback.abandonable)
    _wrap(trainer, "predict", callback.abandonable)
    _wrap(trainer, "_evaluate", callback.loop_evaluation)
    _wrap(trainer, "_load_rng_state", callback.rng_loaded)


def attach(trainer: Any, *, exit_on_preemption: bool = True) -> PreemptibleCallback:
    """Give a ``transformers.Trainer`` (or subclass) the operator contract; idempotent.

    Adds a :class:`PreemptibleCallback` and wraps ``trainer.train`` and
    ``trainer._save_checkpoint`` on this instance. ``exit_on_preemption=False`` makes ``train()``
    return after a JIT stop (``callback.preempted`` is True) instead of exiting with 75.
    """
    existing = getattr(trainer, _ATTR, None)
    if existing is not None:
        return existing
    for name in ("_save_checkpoint", "train", "_get_output_dir", "callback_handler"):
        if not hasattr(trainer, name):
            raise ConfigurationError(
                f"attach() needs a transformers.Trainer; {type(trainer).__name__} has no {name}"
            )
    callback = PreemptibleCallback(exit_on_preemption=exit_on_preemption)
    callback.trainer = trainer
    _drop_jit_callback(trainer)
    _apply_output_dir(trainer, callback)
    save = trainer._save_checkpoint
    train = trainer.train
    _wrap_evaluation(trainer, callback)

    def _save_checkpoint(model: Any, trial: Any = None, *a: Any, **kw: Any) -> Any:
        return callback.committed_save(save, model, trial, *a, **kw)

    def _train(resume_from_checkpoint: Any = None, *a: Any, **kw: Any) -> Any:
        return callback.wrapped_train(train, resume_from_checkpoint, *a, **kw)

    _train.__doc__ = getattr(train, "__doc__", None)
    trainer._save_checkpoint = _save_checkpoint
    trainer.train = _train
    trainer.add_callback(callback)
    setattr(trainer, _ATTR, callback)
    # DataLoader workers vs a SIGTERM to the process group (imported from data, not through
    # hook.shield_dataloaders: hook imports this module)
    from trainer_runtime.data.worker_signals import shield_prepared_dataloaders

    shield_prepared_dataloaders(getattr(trainer, "accelerator", None))
    return callback


# The top-level name: ``from trainer_runtime import attach_preemptible``.
attach_preemptible = attach
