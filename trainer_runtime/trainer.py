"""The Trainer: a Hugging Face style training loop that survives preemption.

Reading order: ``train`` -> ``_train`` (``while not should_stop(): train_step()``) ->
``train_step`` (one optimizer step over the gradient-accumulation micro-batches) ->
``training_step`` (one micro-batch: forward, loss, backward). The loop says when to save or
resume; how (which checkpoint, fallback, rank shares, background writes, JIT supersession) is
checkpointing.py's CheckpointManager. SIGTERM only sets a latch (signals.py) which the loop reads
at step boundaries.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainer_runtime.callbacks import (
    CallbackHandler,
    DefaultFlowCallback,
    TrainerCallback,
)
from trainer_runtime.checkpoint import per_node
from trainer_runtime.checkpoint.background import BackgroundSave, SnapshotBuffers
from trainer_runtime.checkpoint.io import warm_local_writes
from trainer_runtime.checkpoint.layout import TRAINER_STATE_NAME, CheckpointInfo, attempt_from_env
from trainer_runtime.checkpoint.pinned import PinnedStaging
from trainer_runtime.checkpoint.resharding import DataShape, reshard_position
from trainer_runtime.checkpoint.storage import Storage, configure_direct_io
from trainer_runtime.checkpointing import CheckpointManager
from trainer_runtime.data.arguments import (
    build_train_dataloader,
    dataloader_kwargs,
    has_dataset_state,
    is_iterable_dataset,
    set_dataset_epoch,
    skip_batches,
)
from trainer_runtime.data.columns import default_label_names
from trainer_runtime.data.defaults import default_collator_for
from trainer_runtime.data.dispatch import (
    GlobalBatchSampler,
    PaddingBatch,
    SplitCollate,
    SplitStream,
    TaggedDataset,
    dispatch_iterator,
)
from trainer_runtime.data.length_sampling import EPOCH_ORDER_KEY
from trainer_runtime.data.neftune import enable_neftune
from trainer_runtime.data.samplers import ResumableBatchSampler
from trainer_runtime.data.worker_signals import shield_dataloader, shield_prepared_dataloaders
from trainer_runtime.distributed import collectives
from trainer_runtime.distributed.ddp_args import (
    accelerator_kwargs,
    check_accelerator_world,
    dispatch_batches,
    even_batches,
    per_rank_batch_size,
)
from trainer_runtime.distributed.peers import PeerLoss, PeerWatch, peer_failure_in
from trainer_runtime.distributed.trainer_fsdp import FsdpTrainerMixin
from trainer_runtime.elastic import elastic_accumulation
from trainer_runtime.errors import (
    ConfigurationError,
    ResumeError,
)
from trainer_runtime.features import host_memory, losses
from trainer_runtime.features.hub import HubMixin
from trainer_runtime.features.hyperparameter_search import HyperparameterSearchMixin
from trainer_runtime.features.logging_utils import normalize_tokens_seen_mode, speed_metrics
from trainer_runtime.features.model_init import ModelInitMixin, resolve_model
from trainer_runtime.features.optim import (
    create_optimizer,
    create_scheduler,
    decay_parameter_names,
    is_metric_driven,
    optimizer_cls_and_kwargs,
)
from trainer_runtime.features.trainer_features import TrainerFeaturesMixin
from trainer_runtime.jit_stop import JitStopMixin, save_interval_from_env
from trainer_runtime.metrics import TrainingMetrics, metrics_from_env
from trainer_runtime.protocol import (
    ENV_TERMINATION_DIR,
    EXIT_PEER_FAILED,
    EXIT_PREEMPTED,
    REASON_DEADLINE_TOO_SHORT,
    under_operator,
)
from trainer_runtime.signals import SigtermLatch
from trainer_runtime.state import PREEMPTIBLE_KEY, TrainerControl, TrainerState
from trainer_runtime.timings import SaveTimer, StepTimer, timings_record, write_termination
from trainer_runtime.trainer_utils import TrainOutput, set_seed
from trainer_runtime.training_args import TrainingArguments, check_runtime_support

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


def _wait_for_exit(seconds: float = 30.0) -> None:
    """Another thread is ending the process (os._exit); should it not, end it here."""
    time.sleep(seconds)
    os._exit(EXIT_PEER_FAILED)


def _to_device(data: Any, device: torch.device) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, Mapping):
        return type(data)({k: _to_device(v, device) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)):
        return type(data)(_to_device(v, device) for v in data)
    return data


def _size(dataset: Any) -> str:
    try:
        return str(len(dataset))
    except TypeError:
        return "unknown"


def _without_items(batch: Mapping[str, Any], label_names: list[str]) -> dict[str, Any]:
    """``batch`` with its labels set to the ignore index: what a padding batch counts."""
    out = dict(batch)
    for key in [*label_names, "shift_labels"]:
        if isinstance(out.get(key), torch.Tensor):
            out[key] = torch.full_like(out[key], losses.IGNORE_INDEX)
    return out


class _DataPosition:
    """Where the loop is in the data: epoch and micro-batches consumed in it."""

    def __init__(self) -> None:
        self.epoch = 0
        self.batch = 0
        # whether this epoch's iterator began (and took its draw of the global RNG)
        self.started = False

    def to_dict(self, kind: str) -> dict[str, Any]:
        return {"kind": kind, "epoch": self.epoch, "batch": self.batch, "started": self.started}


class Trainer(
    JitStopMixin,
    FsdpTrainerMixin,
    TrainerFeaturesMixin,
    ModelInitMixin,
    HyperparameterSearchMixin,
    HubMixin,
):
    """Train a ``torch.nn.Module`` whose forward returns the loss first (a mapping with ``loss`` or
    a tuple), on a map-style or iterable dataset of examples, with resumable checkpoints and
    just-in-time checkpointing on SIGTERM.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        compute_metrics: Callable[..., dict[str, float]] | None = None,
        callbacks: list[TrainerCallback | type[TrainerCallback]] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        self.args = args if args is not None else TrainingArguments()
        check_runtime_support(self.args)  # transformers fields this runtime cannot honour
        # An elastic attempt keeps the global batch at the size it got (docs/elastic.md).
        if elastic := elastic_accumulation(self.args.gradient_accumulation_steps, os.environ):
            self.args.gradient_accumulation_steps, message = elastic
            logger.warning(message)
        # opt-in only ($PREEMPTIBLE_DIRECT_IO overrides it): docs/checkpoints.md
        configure_direct_io(self.args.checkpoint_direct_io)
        # Seeded before model_init builds the model (features/model_init.py).
        set_seed(self.args.seed, deterministic=self.args.full_determinism)
        self.model_init = model_init
        model = resolve_model(model, model_init, optimizers)
        cuda = not self.args.use_cpu and torch.cuda.is_available()
        self.create_accelerator_and_postprocess()
        shield_prepared_dataloaders(self.accelerator)  # DataLoader workers and SIGTERM: data/
        self.model = model.to(self.accelerator.device)
        # fsdp: sharded here (so evaluate/predict work before train too); never DDP-wrapped.
        self._init_fsdp(user_optimizer=optimizers[0] is not None, cuda=cuda)
        self.model_wrapped: nn.Module = self.model
        # None: transformers' default (pads with processing_class when it is a tokenizer).
        self.data_collator = (
            data_collator if data_collator is not None else default_collator_for(processing_class)
        )
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        # optimizers=(opt, sched): used as given; create_optimizer/create_scheduler keep them.
        self.optimizer, self.lr_scheduler = optimizers
        if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
            raise ConfigurationError(
                "pass either optimizers=(optimizer, scheduler) or optimizer_cls_and_kwargs, "
                "not both"
            )
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        # gradient accumulation: micro-batches in the optimizer step now running, set by the loop
        # before it calls training_step() (which scales a mean loss by it).
        self.current_gradient_accumulation_steps = 1
        # train(ignore_keys_for_eval=...): passed to evaluate() during that train() call.
        self._ignore_keys_for_eval: list[str] | None = None
        self.state = TrainerState(
            is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process,
        )
        self.control = TrainerControl()
        self.callback_handler = CallbackHandler(
            [DefaultFlowCallback, *(callbacks or [])],
            model=self.model,
            processing_class=processing_class,
        )
        # As transformers: the labels forward() names (start/end positions for QA models).
        self.label_names = list(self.args.label_names or default_label_names(self.model))
        self.step_timer = StepTimer()
        self.save_timer = SaveTimer()
        # Mean micro-batch time of each step (gradient accumulation): the micro_batch grace rule.
        self.micro_batch_timer = StepTimer()
        self.sigterm_to_exit: list[float] = []
        # Tests may set it (e.g. with an injected clock) before calling train().
        self.sigterm_latch: SigtermLatch | None = None
        # the watch of the other ranks during train() (peers.py), stamped by the loop
        self._peers: PeerWatch | None = None
        self._latch_used = False
        self.metrics: TrainingMetrics | None = None
        # the running step's label-token count, and the tensor training_step receives for it
        self._step_num_items: int | None = None
        self._step_items: torch.Tensor | None = None
        self.train_dataloader: DataLoader | None = None
        self.train_sampler: ResumableBatchSampler | None = None
        self.last_checkpoint: CheckpointInfo | None = None
        # Save and resume: which checkpoint, fallback, rank shares, background writes and their
        # pinned staging, JIT supersession (checkpointing.py).
        self._checkpoints = CheckpointManager(self)
        self.preempted = False
        self._position = _DataPosition()
        self._data_iter: Iterator[Any] | None = None
        # accelerator_config.dispatch_batches: the main process reads through this loader and
        # sends every rank its share (dispatch.py); None on the other ranks.
        self._dispatch = False
        self._dispatch_loader: DataLoader | None = None
        # True while training_step runs a padding micro-batch (even_batches=False: this rank has
        # no sample left for it); its loss and gradient are zero.
        self.in_padding_batch = False
        # An iterable dataset's own position, loaded from a checkpoint, applied at the epoch start.
        self._dataset_state: dict[str, Any] | None = None
        self._num_batches: int | None = None  # micro-batches per epoch (when known up front)
        self._epoch_length_known = False
        # create_scheduler() built the schedule (rebuilt per train() call, as transformers does).
        self._created_lr_scheduler = False
        # reduce_lr_on_plateau / greedy: stepped with the metric after evaluation, not per step.
        self._metric_schedule = False
        # running loss sums: of this train() call, and since the last log entry
        self._loss_total, self._steps_total = 0.0, 0
        self._loss_since_log, self._steps_since_log = 0.0, 0
        self._last_grad_norm: float | None = None
        # The learning rate the last optimizer step used (read before the scheduler steps).
        self._last_learning_rate: float | None = None
        # Floating-point operations since the last store_flos() (added to state.total_flos).
        self.current_flos = 0.0
        self._flos_params: int | None = None  # non-embedding parameters, for the FLOs estimate
        # Start of the current train() call (time.time()) and the progress it started from.
        self._train_start: float | None = None
        self._initial_tokens_seen = 0
        self._initial_global_step = 0
        self._accepts_loss_kwargs: bool | None = None
        # keyword arguments the forward accepts; None: any (**kwargs); computed on first use
        self._forward_keys: frozenset[str] | None = None
        self._forward_keys_known = False
        self._init_features(preprocess_logits_for_metrics)
        self._init_hub()  # push_to_hub: check hub_model_id, push on every save (features/hub.py)
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    # -- callbacks ---------------------------------------------------------------------------------
    def add_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(
        self, callback: TrainerCallback | type[TrainerCallback]
    ) -> TrainerCallback | None:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type[TrainerCallback]) -> None:
        self.callback_handler.remove_callback(callback)

    def create_accelerator_and_postprocess(self) -> None:
        """Create ``self.accelerator`` (called once by ``__init__``; override to configure it).
        The ddp_* arguments set the process-group backend/timeout and the DDP wrapper's options."""
        cuda = not self.args.use_cpu and torch.cuda.is_available()
        self.accelerator = Accelerator(
            cpu=self.args.use_cpu, **accelerator_kwargs(self.args, cuda=cuda)
        )
        check_accelerator_world(
            process_group_size=collectives.world_size(),
            accelerator_processes=self.accelerator.num_processes,
        )
        collectives.destroy_at_exit()
        if self.accelerator.device.type == "cpu":
            # opt-in only ($PREEMPTIBLE_HOST_MALLOC overrides it): docs/trainer.md
            host_memory.keep_freed_host_memory(self.args.cpu_malloc_tuning)

    def end(self) -> None:
        """Finish the trackers and destroy the process group; call it once, at the very end of a
        script (train/evaluate/predict/save_model communicate between processes)."""
        self.accelerator.end_training()

    def _event(self, name: str, **kwargs: Any) -> None:
        self.control = getattr(self.callback_handler, name)(
            self.args, self.state, self.control, **kwargs
        )

    # -- public entry point ------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: bool | str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """Train; resume from ``resume_from_checkpoint`` (True: newest complete checkpoint of
        output_dir; a path; None: $PREEMPTIBLE_RESUME_FROM; False: never). With model_init the
        model is rebuilt first; ``trial``: a hyperparameter-search trial (model_init.py).

        ``ignore_keys_for_eval``: output keys evaluate() ignores during training. ``trial``
        belongs to hyperparameter search (None otherwise).

        Under the operator's environment, a JIT stop ends the process with EXIT_PREEMPTED after
        writing the termination message; as a plain library it returns with
        ``control.should_training_stop`` set and ``trainer.preempted`` True.
        """
        # Kept for hyperparameter search (which passes it); plain training passes None.
        self._trial = trial
        self._ignore_keys_for_eval = ignore_keys_for_eval
        self._prepare_train(trial)
        operator = under_operator()
        if self.sigterm_latch is None or self._latch_used:
            # A fresh latch per run: a SIGTERM that stopped an earlier train() call is spent.
            self.sigterm_latch = SigtermLatch()
        latch = self.sigterm_latch
        self._latch_used = True
        self._jit_stop_kind = None
        self._save_became_jit = False
        self._save_deferred = False
        self._rng_for_checkpoint = None
        self._save_interval = save_interval_from_env()
        self._interval_anchor = None
        # Installed before the checkpoint is loaded: a SIGTERM during a slow resume is latched
        # (and answered with a checkpoint) instead of killing the process.
        if self.args.enable_jit_checkpoint:
            latch.install()
        keep_handler = False
        # Another rank gone (crashed, killed, node lost) ends this one within seconds with
        # EXIT_PEER_FAILED, instead of a hang in the next collective until the SIGKILL.
        peers = self._start_peer_watch() if operator else None
        try:
            # A bad output dir fails the attempt here, before any step: an unknown scheme, a
            # bucket that does not exist, missing or wrong credentials, a read-only store.
            Storage(str(self.args.output_dir)).check_access(
                write=self.accelerator.is_local_main_process
            )
            # save_on_each_node: refuse shared storage before any step is spent (a collective)
            per_node.check_storage_not_shared(self.args, self.accelerator.local_process_index)
            checkpoint = self._checkpoints.resolve(resume_from_checkpoint)
            output = self._train(checkpoint)
            if self.preempted and 0 < self.state.max_steps <= self.state.global_step:
                # The stop landed on the last step: training is finished, not interrupted, so the
                # next attempt must not be started for zero steps.
                self.preempted = False
            if operator and self.preempted:
                # None on a rank that did not itself receive the SIGTERM (another rank did)
                elapsed = latch.elapsed()
                no_save = self._jit_stop_kind == "no_save"
                self._write_termination(
                    REASON_DEADLINE_TOO_SHORT if no_save else "preempted",
                    sigterm_to_exit=elapsed,
                    message=self._deadline_message if no_save else None,
                )
                written = self.last_checkpoint.path if self.last_checkpoint else None
                logger.warning(
                    "preempted: %s, exiting with %d%s",
                    "no checkpoint written (deadline too short)"
                    if no_save
                    else f"checkpoint {written} written",
                    EXIT_PREEMPTED,
                    f" {elapsed:.2f} s after SIGTERM" if elapsed is not None else "",
                )
                # Keep ignoring SIGTERM while the interpreter shuts down: a second SIGTERM must
                # not turn exit code 75 into death by signal.
                keep_handler = True
                raise SystemExit(EXIT_PREEMPTED)
            if operator:
                self._write_termination("completed")
                # A SIGTERM between here and the process exit must not turn a finished run into
                # death by signal (exit 143): keep latching it.
                keep_handler = True
            return output
        except BaseException as exc:
            if operator and not isinstance(exc, SystemExit | KeyboardInterrupt):
                if peers is not None:
                    self._end_if_peer_gone(peers, exc)
                self._write_termination("failed", message=f"{type(exc).__name__}: {exc}")
                if peers is not None:
                    # After the message is written: the others stop at once, and the operator
                    # then deletes this pod too. Its SIGTERM, latched, must not turn this exit 1
                    # (the cause of the attempt's end) into death by signal.
                    peers.announce_failure(f"{type(exc).__name__}: {exc}")
                    keep_handler = True
            raise
        finally:
            if peers is not None:
                peers.stop()
            if not keep_handler:
                latch.uninstall()

    # -- other ranks gone ------------------------------------------------------------------------
    def _start_peer_watch(self) -> PeerWatch | None:
        self._peers = None
        if not collectives.is_distributed():
            return None
        latch = self.sigterm_latch
        watch = PeerWatch(
            collectives.rank(),
            collectives.world_size(),
            self._end_for_peer,
            # after a SIGTERM: when to judge whether a rank hung (peers.py)
            seconds_left=latch.seconds_left if latch is not None else None,
        )
        if not watch.enabled:
            return None
        self._peers = watch.start()
        return self._peers

    def _stamp(self, phase: str) -> None:
        """The training loop's own progress stamp (main thread only): a rank whose stamps stop
        while the others' go on is hung, not merely alive (peers.py)."""
        if self._peers is not None:
            self._peers.stamp(phase)

    def _end_if_peer_gone(self, peers: PeerWatch, exc: BaseException) -> None:
        """After ``exc`` in training: end as EXIT_PEER_FAILED when another rank is gone (it failed
        first, or the collective says its connection closed); else return (this rank's own
        failure: the caller reports and announces it)."""
        if peers.loss is not None:
            _wait_for_exit()  # the watch thread is ending the process
        loss = peers.announced()
        detail = peer_failure_in(exc)
        if loss is None and detail is not None:
            loss = PeerLoss(None, detail)
        if loss is not None:
            if peers.claim(loss):
                peers.announce(loss)
                self._end_for_peer(loss)
            _wait_for_exit()

    def _end_for_peer(self, loss: PeerLoss) -> None:
        """Write the termination message naming the rank that is gone and exit EXIT_PEER_FAILED
        now, from whichever thread: the main one may be stuck in a collective, and the process
        group's teardown could hang on the dead peer too. The rank found hung itself fails
        (exit 1, its own ``failed`` message): it is the cause, not a peer of it."""
        own = collectives.rank()
        message = loss.message(own)
        itself = loss.hung and loss.rank == own
        code = 1 if itself else EXIT_PEER_FAILED
        logger.error("%s; exiting with %d", message, code)
        self._write_termination(
            "failed", message=message, failed_rank=loss.rank, peer_gone=not itself
        )
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    # -- resume (the how: checkpointing.py) -------------------------------------------------------
    def _load_resume_checkpoint(self, info: CheckpointInfo) -> CheckpointInfo | None:
        """Load ``info``, falling back to the previous complete checkpoint when it is corrupt on
        any rank (:meth:`CheckpointManager.load_with_fallback`); returns what was loaded."""
        return self._checkpoints.load_with_fallback(info)

    def _resume_start_state(self) -> dict[str, Any]:
        """What loading a checkpoint changes besides the model (which the next load overwrites),
        as it is before the first load: copied back before a fallback loads another one."""
        optimizer = self.optimizer
        return {
            "state": copy.deepcopy(self.state),
            # a fresh optimizer has no per-parameter state yet: its state_dict is small
            "optimizer": copy.deepcopy(optimizer.state_dict())
            if optimizer is not None and not optimizer.state
            else None,
            "scheduler": copy.deepcopy(self.lr_scheduler.state_dict())
            if self.lr_scheduler is not None
            else None,
            "timers": copy.deepcopy((self.step_timer, self.save_timer, self.micro_batch_timer)),
            "sigterm_to_exit": list(self.sigterm_to_exit),
        }

    def _restore_resume_start_state(self, saved: dict[str, Any]) -> None:
        # in place: whatever holds the state object keeps seeing the current one
        vars(self.state).update(vars(copy.deepcopy(saved["state"])))
        if saved["optimizer"] is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(saved["optimizer"]))
        if saved["scheduler"] is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(copy.deepcopy(saved["scheduler"]))
        self.step_timer, self.save_timer, self.micro_batch_timer = copy.deepcopy(saved["timers"])
        self.sigterm_to_exit = list(saved["sigterm_to_exit"])
        self._position = _DataPosition()
        self._dataset_state = None

    # -- setup -------------------------------------------------------------------------------------
    def _is_iterable(self) -> bool:
        return is_iterable_dataset(self.train_dataset)

    def _data_seed(self) -> int:
        return self.args.data_seed if self.args.data_seed is not None else self.args.seed

    def _model_input_name(self) -> str | None:
        names = getattr(self.processing_class, "model_input_names", None)
        return names[0] if names else None

    def get_train_dataloader(self) -> DataLoader:
        """The training DataLoader (data_args.build_train_dataloader): map-style datasets are driven
        by the resumable batch sampler of ``train_sampling_strategy``, sharded over ranks."""
        if self.train_dataset is None:
            raise ConfigurationError("Trainer.train() requires a train_dataset")
        world = collectives.world_size()
        self._dispatch = dispatch_batches(self.args, iterable=self._is_iterable(), world_size=world)
        if self._is_iterable() and collectives.is_distributed() and not self._dispatch:
            logger.warning(
                "iterable dataset with %d ranks and accelerator_config.dispatch_batches=False: "
                "each rank iterates the dataset as given; shard it per rank "
                "(torch.distributed.get_rank()) to avoid duplicates",
                world,
            )
        # The DataLoader gets a private generator (data_seed): it draws its base seed from it, not
        # from the global torch RNG, so creating an iterator mid-epoch on resume does not shift
        # the global RNG.
        loader = build_train_dataloader(
            # A datasets.Dataset loses its unused columns before collation (the length column
            # stays: the length samplers read it).
            self._drop_unused_columns(self.train_dataset, keep=[self.args.length_column_name]),
            self.args,
            collate_fn=self._collator_for(self.train_dataset),
            seed=self._data_seed(),
            batch_size=per_rank_batch_size(self.args, collectives.world_size()),
            gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            num_replicas=collectives.world_size(),
            rank=collectives.rank(),
            max_steps=self.args.max_steps,
            model_input_name=self._model_input_name(),
        )
        sampler = loader.batch_sampler
        self.train_sampler = sampler if isinstance(sampler, ResumableBatchSampler) else None
        if self.train_sampler is not None:
            self.train_sampler.even_batches = even_batches(self.args)
        self._dispatch_loader = None
        if self._dispatch and self.accelerator.is_main_process:
            self._dispatch_loader = self._build_dispatch_loader(loader)
        return loader

    def _check_custom_loader(self) -> None:
        """An overridden get_train_dataloader() may return any DataLoader: its position is then
        restored by skipping batches (as transformers does), not by our resumable sampler."""
        loader = self.train_dataloader
        if self.train_sampler is not None and getattr(loader, "batch_sampler", None) is not (
            self.train_sampler
        ):
            # get_train_dataloader() ran (it set the sampler) but another loader was returned.
            self.train_sampler = None
        if self.train_sampler is not None or self._is_iterable():
            return
        if loader is None or not hasattr(loader, "__iter__"):
            raise ConfigurationError(
                f"get_train_dataloader() must return an iterable DataLoader, got "
                f"{type(loader).__name__}"
            )
        if self._dispatch:
            raise ConfigurationError(
                "accelerator_config.dispatch_batches=True needs the DataLoader this Trainer's "
                "get_train_dataloader() builds; an overridden one must not set it"
            )
        logger.info(
            "get_train_dataloader() returned its own DataLoader: on resume its position is "
            "restored by skipping the batches already consumed in the epoch"
        )
        if collectives.is_distributed():
            logger.warning(
                "get_train_dataloader() returned its own DataLoader with %d ranks: each rank "
                "reads it as given; shard it per rank (e.g. DistributedSampler) to avoid "
                "duplicates",
                collectives.world_size(),
            )

    def _build_dispatch_loader(self, loader: DataLoader) -> DataLoader:
        """The main process's loader under dispatch_batches: each item is a list of per-rank
        batches (map-style: every rank's sampler batch; iterable: one global batch, split)."""
        world = collectives.world_size()
        generator = torch.Generator()
        generator.manual_seed(self._data_seed())
        options = dataloader_kwargs(self.args)
        if self.train_sampler is not None:
            return DataLoader(
                TaggedDataset(loader.dataset),
                batch_sampler=GlobalBatchSampler(self.train_sampler),
                collate_fn=SplitCollate(self._collator_for(self.train_dataset), world),
                generator=generator,
                **options,
            )
        batch_size = per_rank_batch_size(self.args, world)
        return DataLoader(
            loader.dataset,
            batch_size=batch_size * world,
            drop_last=bool(self.args.dataloader_drop_last),
            collate_fn=SplitStream(
                self._collator_for(self.train_dataset),
                world,
                batch_size,
                even_batches=even_batches(self.args),
            ),
            generator=generator,
            **options,
        )

    # -- optimizer and schedule (each overridable, called by train() as transformers does) ---------
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """The optimizer, then the schedule over ``num_training_steps``. train() calls
        create_optimizer() and create_scheduler() itself, as transformers' does: override those
        (or pass ``optimizers=(optimizer, scheduler)``) to change what training uses."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps)

    def _warn_unused_override(self) -> None:
        if type(self).create_optimizer_and_scheduler is not Trainer.create_optimizer_and_scheduler:
            logger.warning(
                "%s overrides create_optimizer_and_scheduler(), which train() does not call (as "
                "in transformers): override create_optimizer() / create_scheduler() or pass "
                "optimizers=(optimizer, scheduler)",
                type(self).__name__,
            )

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """``self.optimizer`` when set (``optimizers=`` or an earlier call); else the optimizer of
        ``args.optim`` (or ``optimizer_cls_and_kwargs``) over two groups, weight decay on
        ``get_decay_parameter_names(model)`` only."""
        opt_model = self.model if model is None else model
        if self.optimizer is None:
            cls_and_kwargs = self.optimizer_cls_and_kwargs
            if cls_and_kwargs is None:
                cls_and_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = create_optimizer(
                opt_model,
                self.args,
                decay_names=self.get_decay_parameter_names(opt_model),
                cls_and_kwargs=cls_and_kwargs,
            )
        return self.optimizer

    def create_scheduler(
        self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None
    ) -> Any:
        """``self.lr_scheduler`` when set; else the schedule of ``args.lr_scheduler_type`` over
        ``num_training_steps`` for ``optimizer`` (default: ``self.optimizer``). The metric-driven
        ones (reduce_lr_on_plateau, greedy) are stepped after each evaluation, not per step."""
        if self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            if optimizer is None:
                raise ConfigurationError(
                    "create_scheduler() needs an optimizer: call create_optimizer() first or "
                    "pass optimizer=..."
                )
            self.lr_scheduler = create_scheduler(
                optimizer, self.args, num_training_steps, metric_driven=True
            )
            # Built here, so rebuilt by the next train() call (its step count may differ).
            self._created_lr_scheduler = True
        return self.lr_scheduler

    @staticmethod
    def get_optimizer_cls_and_kwargs(
        args: TrainingArguments, model: nn.Module | None = None
    ) -> tuple[Any, Any]:
        """The optimizer class of ``args.optim`` and its keyword arguments (no parameters)."""
        return optimizer_cls_and_kwargs(args, model)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """Names of the parameters weight decay applies to: not biases, not norm weights."""
        return decay_parameter_names(model)

    def get_num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ConfigurationError(
                "the Trainer has no optimizer yet: call create_optimizer() or train() first"
            )
        return self.optimizer

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each optimizer parameter group."""
        return [group["lr"] for group in self._require_optimizer().param_groups]

    def get_optimizer_group(self, param: str | nn.Parameter | None = None) -> Any:
        """The optimizer group holding ``param``; without it, every group's parameters."""
        groups = self._require_optimizer().param_groups
        if param is not None:
            for group in groups:
                if any(p is param for p in group["params"]):
                    return group
        return [group["params"] for group in groups]

    def _loader_length(self) -> int | None:
        """Micro-batches per epoch: our sampler's length, or the length of a DataLoader that an
        overridden get_train_dataloader() returned; None when unknown (iterable data)."""
        if self.train_sampler is not None:
            return len(self.train_sampler)
        if self._is_iterable():
            return None
        try:
            return len(self.train_dataloader)  # type: ignore[arg-type]
        except TypeError:
            return None

    def _plan_steps(self) -> tuple[int, int]:
        """(max_steps, num_train_epochs) of the run."""
        args = self.args
        length = self._loader_length()
        self._epoch_length_known = length is not None
        if length is None:
            if args.max_steps <= 0:
                raise ConfigurationError(
                    f"max_steps={args.max_steps} with an iterable train_dataset (or a train "
                    "dataloader without a length): the epoch length is unknown, so set max_steps "
                    "to the number of optimizer steps to train"
                )
            return args.max_steps, math.ceil(args.num_train_epochs)
        self._num_batches = length
        if self._num_batches == 0:
            raise ConfigurationError(
                f"the train dataloader yields no batch (train_dataset size "
                f"{_size(self.train_dataset)}, "
                f"per_device_train_batch_size={args.per_device_train_batch_size}, "
                f"dataloader_drop_last={args.dataloader_drop_last})"
            )
        steps_per_epoch = math.ceil(self._num_batches / args.gradient_accumulation_steps)
        if args.max_steps > 0:
            max_steps = args.max_steps
        else:
            max_steps = max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
        return max_steps, math.ceil(max_steps / steps_per_epoch)

    def _setup(self, checkpoint: CheckpointInfo | None) -> None:
        args = self.args
        # The sampler of the loader get_train_dataloader() builds (None for an override's own).
        self.train_sampler = None
        self.train_dataloader = shield_dataloader(self.get_train_dataloader())  # overrides too
        self._check_custom_loader()
        max_steps, num_epochs = self._plan_steps()
        if self._created_lr_scheduler:
            # Built by an earlier train() call for its step count: build it again.
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self._warn_unused_override()
        # As transformers' train(): create_optimizer() then create_scheduler(), each overridable
        # (create_optimizer_and_scheduler is a helper for scripts, not called by the loop).
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self._metric_schedule = is_metric_driven(self.lr_scheduler)
        if self._fsdp is None:
            self.model_wrapped = self._maybe_compile(self.accelerator.prepare_model(self.model))
        self.callback_handler.objects.update(
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            train_dataloader=self.train_dataloader,
        )
        self.state = TrainerState(
            max_steps=max_steps,
            num_train_epochs=num_epochs,
            train_batch_size=args.per_device_train_batch_size,
            logging_steps=args.steps_from_ratio(args.logging_steps, max_steps),
            save_steps=args.steps_from_ratio(args.save_steps, max_steps),
            is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process,
        )
        self.control = TrainerControl()
        self._position = _DataPosition()
        self.last_checkpoint = None
        # What was loaded (a fallback may load an earlier one): the termination message says it.
        self._resumed_from: CheckpointInfo | None = None
        if checkpoint is not None:
            self._resumed_from = self._load_resume_checkpoint(checkpoint)
            self._load_callback_state()
        self._checkpoints.note_resumed(self._resumed_from)
        self.state.preemptible["attempt"] = attempt_from_env()
        if self.state.global_step >= self.state.max_steps:
            # Resumed from the final checkpoint (e.g. preempted right after it): nothing to do.
            logger.info(
                "step %d already reaches max_steps=%d: nothing to train",
                self.state.global_step,
                self.state.max_steps,
            )
            self.control.should_training_stop = True
        self._start_epoch_iterator(skip=self._position.batch)

    # -- the loop ----------------------------------------------------------------------------------
    def _train(self, checkpoint: CheckpointInfo | None) -> TrainOutput:
        self._setup(checkpoint)
        if (
            self.args.save_strategy != "no"
            or self.args.enable_jit_checkpoint
            or self._save_interval
        ):
            # The first save (often the JIT one) must not pay for its staging memory; warmed
            # once the checkpoint is loaded, so that it never slows a resume down.
            warm_local_writes(str(self.args.output_dir))
        self.preempted = False
        self.metrics = self.metrics or metrics_from_env()
        self._publish_metrics()
        # time.time(), as speed_metrics measures against it
        self._train_start = time.time()
        self._initial_tokens_seen = self.state.num_input_tokens_seen
        self._initial_global_step = self.state.global_step
        try:
            # NEFTune noise only while training; the hook goes on every exit path.
            with enable_neftune(self.model, self.args.neftune_noise_alpha):
                self.is_in_train = True
                self._event("on_train_begin")
                if self.args.eval_on_start:
                    # As transformers: a metric-driven schedule is not stepped by this one.
                    self._evaluate_during_training(skip_scheduler=True)
                self._event("on_epoch_begin")
                self._run_pending_evaluation()
                while not self.should_stop():
                    self.train_step()
                    if self.preempted:
                        break  # the step was dropped at a micro-batch boundary and saved
                    self._after_step()
                self._checkpoints.finish()
            # As transformers: the summary goes through log() (on_log, trackers) before the best
            # model is loaded and on_train_end is called.
            output = self._train_output(self._train_start)
            if not self.preempted:
                self._load_best_model_at_end()
            self._event("on_train_end")
        finally:
            self._checkpoints.abandon()
            self.is_in_train = False
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
        return output

    def should_stop(self) -> bool:
        """Stop when done, when a callback asks, or (all ranks agreeing) after a SIGTERM."""
        # should_training_stop is the same on every rank (it follows the step count), so skipping
        # the collective below when it is set keeps the ranks in step. A finished run is
        # "completed" even if a SIGTERM arrived during its last step.
        if self._save_became_jit and not self.preempted:
            # A periodic save fell due after SIGTERM and was left to this stop (every rank
            # agreed): the JIT save writes this step now, before the last step's "finished".
            self._stop_for_preemption()
            return True
        self._stamp(f"step {self.state.global_step}")
        if self.control.should_training_stop:
            if self._save_deferred and not self.preempted and self._save_fits_deadline():
                # Training ended within the kill wait after a due save was left to the stop:
                # the JIT path writes the last step (the run still ends as it would have).
                self.save_checkpoint(jit=True)
            return True
        if not self.args.enable_jit_checkpoint:
            return False
        wants_jit = bool(self.sigterm_latch and self.sigterm_latch.should_act())
        # Every rank takes part in the collective every step, so they stop at the same step.
        if collectives.agree_to_stop(wants_jit):
            self._stop_for_preemption()
            return True
        return False

    def train_step(self) -> None:
        """One optimizer step over up to gradient_accumulation_steps micro-batches."""
        started = time.perf_counter()
        # Before the micro-batches are read: what a stop at a micro-batch boundary puts back.
        snapshot = self._step_snapshot()
        self.control._new_step()
        batches = self._next_micro_batches()
        # Padding micro-batches (even_batches=False) carry no samples: count nothing for them.
        self._count_tokens([b for b in batches if not isinstance(b, PaddingBatch)])
        num_items = losses.count_items_in_batch(
            [
                _without_items(b, self.label_names) if isinstance(b, PaddingBatch) else b
                for b in batches
            ],
            shift_labels=losses.is_causal_lm(self.model),
            label_name=self.label_names[0],
            across_ranks=self.args.average_tokens_across_devices and collectives.is_distributed(),
        )
        # The count scales mean losses exactly (_scale_mean_loss); what training_step and
        # compute_loss receive is transformers' value: a tensor on the device, or None.
        self._step_num_items = num_items
        self._step_items = self._loss_num_items(num_items)
        self._event("on_step_begin")
        self.model_wrapped.train()
        step_loss = torch.zeros((), device=self.accelerator.device)
        # training_step() divides a mean loss by it (transformers' attribute of the same name):
        # the micro-batches of this step, fewer than gradient_accumulation_steps at an epoch end.
        self.current_gradient_accumulation_steps = len(batches)
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            # Gradients are all-reduced once per optimizer step, on the last micro-batch.
            sync = contextlib.nullcontext() if last else self._no_sync(self.model_wrapped)
            with sync:
                step_loss += self.training_step(self.model_wrapped, batch, self._step_items)
            if not isinstance(batch, PaddingBatch):
                self.current_flos += float(self.floating_point_ops(batch))
            if not last:
                self._event("on_substep_end")
                per_batch = (time.perf_counter() - started) / (i + 1)
                if self._stop_inside_step(snapshot, len(batches) - i - 1, per_batch):
                    self._drop_partial_step(snapshot, len(batches))  # type: ignore[arg-type]
                    return
        # Clipped (or only measured) before on_pre_optimizer_step, as transformers does.
        self._last_grad_norm = self._clip_and_measure_grad_norm()
        self._event("on_pre_optimizer_step")
        assert self.optimizer is not None and self.lr_scheduler is not None
        self.optimizer.step()
        self._event("on_optimizer_step")
        # The rate this step used; after scheduler.step() get_last_lr() is the next step's.
        self._last_learning_rate = self._get_learning_rate()
        if not self._metric_schedule:
            # reduce_lr_on_plateau / greedy are stepped with the metric after evaluation instead.
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        self._after_optimizer_step()
        # One host sync per step: the measured step time then includes the device work, which
        # is what the grace period must cover.
        loss_value = float(step_loss.item())
        filtered = self.args.logging_nan_inf_filter and not math.isfinite(loss_value)
        if filtered and self._steps_since_log:
            # Logging only: a NaN/Inf step counts as the mean of the valid ones since the last log.
            loss_value = self._loss_since_log / self._steps_since_log
        self._loss_total += loss_value
        self._steps_total += 1
        self._loss_since_log += loss_value
        self._steps_since_log += 1
        step_seconds = time.perf_counter() - started
        self.step_timer.record(step_seconds)
        if len(batches) > 1:
            self.micro_batch_timer.record(step_seconds / len(batches))
        self._update_epoch_float()
        self._event("on_step_end")

    def _clip_and_measure_grad_norm(self) -> float:
        """The total gradient norm before clipping; clips to max_grad_norm when it is > 0 (a
        norm is logged either way, as transformers does)."""
        limit = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), limit)
        return self._grad_norm_value(norm)

    def _get_learning_rate(self) -> float:
        assert self.lr_scheduler is not None
        if is_metric_driven(self.lr_scheduler):
            assert self.optimizer is not None
            return float(self.optimizer.param_groups[0]["lr"])
        return float(self.lr_scheduler.get_last_lr()[0])

    def floating_point_ops(self, inputs: Mapping[str, Any]) -> float:
        """Forward + backward FLOs of one micro-batch, the estimate transformers uses: the
        model's own ``floating_point_ops(inputs)`` when it has one, else for a model with
        ``num_parameters`` (a ``PreTrainedModel``) 6 x tokens of its main input x non-embedding
        parameters; 0 otherwise. Override for another estimate."""
        own = getattr(self.model, "floating_point_ops", None)
        if callable(own):
            return float(own(inputs))
        main_input = getattr(self.model, "main_input_name", "input_ids")
        value = inputs.get(main_input)
        count = getattr(self.model, "num_parameters", None)
        if not isinstance(value, torch.Tensor) or not callable(count):
            return 0.0
        if self._flos_params is None:
            # Counted once: walking the parameters every micro-batch costs time on large models.
            self._flos_params = int(count(exclude_embeddings=True))
        return float(6 * value.numel() * self._flos_params)

    def store_flos(self) -> None:
        """Add the FLOs since the last call (summed over ranks) to state.total_flos."""
        flos, self.current_flos = self.current_flos, 0.0
        self.state.total_flos += float(collectives.all_reduce_sum(int(flos)))

    def _loss_num_items(self, count: int | None) -> torch.Tensor | None:
        """``num_items_in_batch`` as transformers hands it to ``training_step`` and
        ``compute_loss`` (in training and evaluation): a 0-dim tensor of the default float dtype
        on the device (transformers divides the count by its parallel sizes), and only when the
        loss uses it (the model takes loss kwargs, or a ``compute_loss_func`` is set)."""
        if count is None or not (
            self._model_accepts_loss_kwargs() or self.compute_loss_func is not None
        ):
            return None
        return torch.tensor(float(count), device=self.accelerator.device)

    def _num_items_count(self, num_items_in_batch: int | torch.Tensor | None) -> int | None:
        """The step's label-token count as an int (no device sync for the loop's own tensor)."""
        if num_items_in_batch is None or num_items_in_batch is self._step_items:
            return self._step_num_items
        return int(num_items_in_batch)

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward, loss scaled to its share of the optimizer step, backward; returns the loss.

        A mean loss is divided by ``current_gradient_accumulation_steps`` (set by the loop for the
        step now running) or, given ``num_items_in_batch``, weighted by its share of the step's
        label tokens."""
        self.in_padding_batch = isinstance(inputs, PaddingBatch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"compute_loss() must return a torch.Tensor loss, got {type(loss).__name__}"
            )
        scaled = losses.loss_is_scaled(
            None,
            model_accepts_loss_kwargs=self._model_accepts_loss_kwargs(),
            has_compute_loss_func=self.compute_loss_func is not None,
            num_items_in_batch=num_items_in_batch,
            has_label_smoother=self.label_smoother is not None,
        )
        if not scaled:
            loss = self._scale_mean_loss(
                inputs,
                loss,
                self._num_items_count(num_items_in_batch),
                self.current_gradient_accumulation_steps,
            )
        if self.in_padding_batch:
            # The forward/backward only keeps DDP's all-reduce in step: zero loss, zero gradient.
            loss = loss.nan_to_num(0.0, 0.0, 0.0) * 0.0
        self.accelerator.backward(loss)
        self.in_padding_batch = False
        return loss.detach()

    def _scale_mean_loss(
        self,
        inputs: Mapping[str, Any],
        loss: torch.Tensor,
        num_items: int | None,
        num_micro_batches: int,
    ) -> torch.Tensor:
        """Turn a per-micro-batch mean loss into its exact share of the accumulated batch.

        A model that does not take ``num_items_in_batch`` returns the mean over its own label
        tokens; weighting it by (tokens here / tokens in the step) makes the sum over micro-batches
        the mean over the whole step. Without labels, the micro-batches are averaged.
        """
        if num_items:
            local = losses.count_items_in_batch(
                [inputs],
                shift_labels=losses.is_causal_lm(self.model),
                label_name=self.label_names[0],
            )
            if local is not None:
                if local == 0:
                    # A mean over zero tokens is NaN; this micro-batch carries no signal.
                    return loss.nan_to_num(0.0) * 0.0
                weight = local / num_items
                if self.args.average_tokens_across_devices and collectives.is_distributed():
                    weight *= collectives.world_size()
                return loss * weight
        return loss / num_micro_batches

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The loss of one micro-batch (Hugging Face semantics, see losses.compute_loss); the
        callers run it inside compute_loss_context_manager() (autocast)."""
        loss, outputs = losses.compute_loss(
            model,
            inputs,
            num_items_in_batch=num_items_in_batch,
            compute_loss_func=self.compute_loss_func,
            label_smoother=self.label_smoother,
            label_names=self.label_names,
            accepts_loss_kwargs=self._model_accepts_loss_kwargs(),
            world_size=collectives.world_size(),
            average_tokens_across_devices=self.args.average_tokens_across_devices,
        )
        return (loss, outputs) if return_outputs else loss

    def _prepare_inputs(self, inputs: Any) -> Any:
        if not isinstance(inputs, Mapping):
            raise TypeError(
                f"a batch must be a mapping of model inputs, got {type(inputs).__name__}; "
                "return dicts from the dataset or the data_collator"
            )
        inputs = dict(inputs)
        if self.args.remove_unused_columns:
            inputs = self._remove_unused(inputs)
        return _to_device(inputs, self.accelerator.device)

    def _model_accepts_loss_kwargs(self) -> bool:
        if self._accepts_loss_kwargs is None:
            self._accepts_loss_kwargs = losses.model_accepts_loss_kwargs(self.model)
        return self._accepts_loss_kwargs

    def _remove_unused(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if not self._forward_keys_known:
            self._forward_keys_known = True
            try:
                params = inspect.signature(self.model.forward).parameters
            except (TypeError, ValueError):
                params = None
            if params is not None and not any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
            ):
                keep = set(params)
                if self.compute_loss_func is not None:
                    keep |= set(self.label_names)  # popped before the forward pass
                self._forward_keys = frozenset(keep)
        if self._forward_keys is None:
            return inputs
        return {k: v for k, v in inputs.items() if k in self._forward_keys}

    # -- data --------------------------------------------------------------------------------------
    def _start_epoch_iterator(self, skip: int = 0) -> None:
        """Iterator over the current epoch, positioned ``skip`` micro-batches in."""
        assert self.train_dataloader is not None
        epoch = self._position.epoch
        private = getattr(self.train_dataloader, "generator", None) is not None
        fresh = not skip and not self._position.started
        if fresh and private:
            # transformers' DataLoader draws its base seed from the global torch RNG when an
            # epoch's iterator starts; ours draws it from its private generator (so a resume
            # mid-epoch does not shift the global RNG). Take that one draw here, at the start of
            # an epoch, so dropout and every other use of the global RNG see the same state as
            # under transformers (a checkpoint of this epoch holds the state after it, and
            # says so: the position's "started").
            torch.empty((), dtype=torch.int64).random_()
        self._position.started = True
        if self.train_sampler is not None:
            self.train_sampler.load_state_dict({"epoch": epoch, "start": skip})
            begin = getattr(self.train_sampler, "begin_epoch", None)
            if begin is not None:
                # group_by_length on one process draws the epoch's order from the global RNG
                # now, as transformers' sampler does; a resume rebuilds it from the record.
                saved = None if fresh else self.state.preemptible.get(EPOCH_ORDER_KEY)
                record = begin(epoch, saved)
                if record is None:
                    self.state.preemptible.pop(EPOCH_ORDER_KEY, None)
                else:
                    self.state.preemptible[EPOCH_ORDER_KEY] = record
            self._data_iter = self._dispatched(self._epoch_source())
            return
        set_dataset_epoch(self.train_dataset, epoch, self._data_seed())
        for sampler in (
            getattr(self.train_dataloader, "sampler", None),
            getattr(self.train_dataloader, "batch_sampler", None),
        ):
            # An overridden get_train_dataloader()'s DistributedSampler reshuffles per epoch.
            if callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch)  # type: ignore[union-attr]
        state, self._dataset_state = self._dataset_state, None
        if skip and state is not None:
            # The dataset's own position: nothing is read again.
            self.train_dataset.load_state_dict(state)  # type: ignore[union-attr]
            self._data_iter = self._dispatched(self._epoch_source())
            return
        source = self._epoch_source()
        if not self._is_iterable():
            why = (
                "get_train_dataloader() returned a DataLoader without this Trainer's resumable "
                "sampler"
            )
        elif has_dataset_state(self.train_dataset) and self.args.dataloader_num_workers > 0:
            why = "the dataset's state_dict() is not tracked with dataloader_num_workers > 0"
        else:
            why = "the dataset has no state_dict()/load_state_dict() to restore its position"
        if source is not None:
            # Under dispatch only the main process reads, so only it skips (global batches).
            skip_batches(
                source,
                skip,
                disable=bool(self.args.disable_tqdm) or not self.accelerator.is_local_main_process,
                why=why,
            )
        self._data_iter = self._dispatched(source)

    def _epoch_source(self) -> Iterator[Any] | None:
        """The loader iterator this process reads: its own, or under dispatch_batches the main
        process's global one (None on the other ranks, which only receive)."""
        assert self.train_dataloader is not None
        if not self._dispatch:
            return iter(self.train_dataloader)
        return iter(self._dispatch_loader) if self._dispatch_loader is not None else None

    def _dispatched(self, source: Iterator[Any] | None) -> Iterator[Any]:
        if not self._dispatch:
            assert source is not None
            return source
        return dispatch_iterator(source, rank=collectives.rank())

    def _epoch_exhausted(self) -> bool:
        return self._num_batches is not None and self._position.batch >= self._num_batches

    def _next_micro_batches(self) -> list[Any]:
        """Up to gradient_accumulation_steps micro-batches; never spans two epochs."""
        assert self._data_iter is not None
        batches: list[Any] = []
        while len(batches) < self.args.gradient_accumulation_steps:
            if self._epoch_exhausted():
                break
            try:
                batch = next(self._data_iter)
            except StopIteration:
                if not batches and self._position.batch == 0:
                    raise ConfigurationError(
                        "the iterable train_dataset yielded no batch in epoch "
                        f"{self._position.epoch}"
                    ) from None
                self._num_batches_seen_end()
                if batches:
                    break
                # An iterable dataset ran out at a step boundary: next epoch, keep going.
                self._end_epoch()
                continue
            sampler, position = self.train_sampler, self._position
            if sampler is not None and sampler.is_padding(position.epoch, position.batch):
                # even_batches=False: this rank has no sample left for this micro-batch.
                batch = PaddingBatch(batch)
            batches.append(batch)
            self._position.batch += 1
        if not batches:
            raise RuntimeError("the train dataloader produced no batch for an optimizer step")
        return batches

    def _num_batches_seen_end(self) -> None:
        # For iterable datasets the epoch length is only known once it ends.
        if not self._epoch_length_known:
            self._num_batches = self._position.batch

    def _end_epoch(self) -> None:
        """on_epoch_end (epoch strategies log/save here), then move to the next epoch's data."""
        self._update_epoch_float()
        self._event("on_epoch_end")
        self._log_and_save()
        if self.control.should_training_stop:
            return
        self._position.epoch += 1
        self._position.batch = 0
        self._position.started = False
        if not self._epoch_length_known:
            self._num_batches = None
        self._start_epoch_iterator()
        self.control._new_epoch()
        self._event("on_epoch_begin")

    def _update_epoch_float(self) -> None:
        if self._num_batches:
            self.state.epoch = self._position.epoch + self._position.batch / self._num_batches
        elif self.args.max_steps > 0:
            # An epoch of unknown length (an IterableDataset) counts, as in transformers, as
            # max_steps * gradient_accumulation_steps micro-batches: fractional epochs.
            per_epoch = self.args.max_steps * self.args.gradient_accumulation_steps
            self.state.epoch = self._position.epoch + self._position.batch / per_epoch
        else:
            self.state.epoch = float(self._position.epoch)

    def _after_step(self) -> None:
        """Log and save as the callbacks decided; close the epoch when its data is used up, when
        a callback ends it, or when training stops (max_steps or a callback): transformers
        calls on_epoch_end in all three cases."""
        self._maybe_save_on_interval()
        self._log_and_save()
        if (
            self._epoch_exhausted()
            or self.control.should_epoch_stop
            or self.control.should_training_stop
        ):
            self._end_epoch()

    def _log_and_save(self) -> None:
        if self.control.should_log:
            self._log_training()
        if self.control.should_evaluate:
            # Sets should_save when save_strategy="best" and the metric improved.
            self._evaluate_during_training()
        self._checkpoints.poll()
        if self.control.should_save and self._periodic_save_becomes_jit():
            self.control.should_save = False
        if self.control.should_save and self._checkpoints.stop_while_pending():
            # The JIT stop (should_stop, next) saves this step and supersedes the write in flight.
            self.control.should_save = False
        if self.control.should_save:
            self.save_checkpoint()
        self.control.should_log = False
        self.control.should_save = False
        if str(getattr(self.args.save_strategy, "value", self.args.save_strategy)) == "steps":
            self._checkpoints.maybe_pin_ahead(
                self.state.global_step, self.state.save_steps, self.step_timer.to_model().ema
            )
        self._publish_metrics()

    def _log_training(self) -> None:
        if not self._steps_since_log:
            return
        # The mean over ranks, as transformers logs it; train_loss takes the same values.
        loss_sum = collectives.all_reduce_mean(self._loss_since_log)
        self._loss_total += loss_sum - self._loss_since_log
        # transformers' keys and order: loss, grad_norm, learning_rate (then log() adds epoch).
        logs: dict[str, float] = {"loss": loss_sum / self._steps_since_log}
        if self._last_grad_norm is not None:
            logs["grad_norm"] = self._last_grad_norm
        logs["learning_rate"] = (
            self._last_learning_rate
            if self._last_learning_rate is not None
            else self._get_learning_rate()
        )
        self._loss_since_log, self._steps_since_log = 0.0, 0
        self.store_flos()
        self.log(logs, start_time=self._train_start)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add ``epoch`` (and, with include_num_input_tokens_seen, the token count and, given
        the train start ``start_time``, the token rate) to ``logs``, append them with the step
        to state.log_history and call on_log. ``logs`` is updated in place, as transformers
        does (so evaluate()'s and train()'s metrics carry the epoch too)."""
        if self.state.epoch is not None:
            logs["epoch"] = float(self.state.epoch)
        if normalize_tokens_seen_mode(self.args.include_num_input_tokens_seen) != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None:
                seen = self.state.num_input_tokens_seen - self._initial_tokens_seen
                logs.update(speed_metrics("train", start_time, num_tokens=seen))
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self._event("on_log", logs=logs)

    def _num_train_samples(self, steps: int) -> float:
        """Samples this train() call processed, as transformers reports them: the planned
        samples of the whole schedule times the share of the steps run now."""
        args = self.args
        world = collectives.world_size()
        if args.max_steps > 0 or not self._epoch_length_known:
            total_batch = per_rank_batch_size(args, world) * args.gradient_accumulation_steps
            planned = float(self.state.max_steps * total_batch * world)
        else:
            assert self.train_dataloader is not None
            planned = self.num_examples(self.train_dataloader) * args.num_train_epochs
        return planned * steps / max(self.state.max_steps, 1)

    def _train_output(self, start_time: float) -> TrainOutput:
        """The end-of-training summary, logged through log() (log_history, on_log, trackers)."""
        steps = self._steps_total
        train_loss = self._loss_total / steps if steps else 0.0
        metrics = speed_metrics(
            "train", start_time, num_samples=self._num_train_samples(steps), num_steps=steps
        )
        self.store_flos()
        metrics["total_flos"] = self.state.total_flos
        metrics["train_loss"] = train_loss
        self.log(metrics)
        self._loss_total, self._steps_total = 0.0, 0
        self._loss_since_log, self._steps_since_log = 0.0, 0
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # -- JIT ---------------------------------------------------------------------------------------
    def _stop_for_preemption(self, kind: str = "step") -> None:
        latch = self.sigterm_latch
        assert latch is not None
        if self._jit_stop_kind is None:
            self._jit_stop_kind = kind
        self._stamp(f"JIT stop at step {self.state.global_step}")
        if not self._save_fits_deadline():
            self._exit_without_save()
            return
        if latch.triggered:
            logger.warning(
                "SIGTERM received %.2f s ago: stopping at step %d to write a checkpoint",
                latch.elapsed() or 0.0,
                self.state.global_step,
            )
        else:
            logger.warning(
                "another rank received SIGTERM: stopping at step %d to write a checkpoint",
                self.state.global_step,
            )
        left = latch.seconds_left()
        estimate = self._save_estimate()
        if left is not None and estimate is not None and left < estimate:
            logger.error(
                "GRACE PERIOD TOO SHORT: %.2f s left before the deadline, recent saves took up "
                "to %.2f s; the checkpoint of step %d may not finish (raise the grace period)",
                left,
                estimate,
                self.state.global_step,
            )
        self._stamp(f"JIT save of checkpoint-{self.state.global_step}")
        self.save_checkpoint(jit=True)
        self._stamp(f"exit after checkpoint-{self.state.global_step}")
        left = latch.seconds_left()
        if left is not None and left < 0:
            logger.error(
                "GRACE PERIOD EXCEEDED: the JIT checkpoint finished %.2f s after SIGTERM, %.2f s "
                "past the %.0f s grace period; on Kubernetes the pod would have been killed",
                latch.elapsed() or 0.0,
                -left,
                latch.grace_seconds or 0.0,
            )
        self.preempted = True
        self.control.should_training_stop = True

    # -- checkpoints -------------------------------------------------------------------------------
    def _preemptible_record(self, jit: bool, background: bool = False) -> dict[str, Any]:
        elapsed = self.sigterm_latch.elapsed() if jit and self.sigterm_latch else None
        kind = "iterable" if self.train_sampler is None else "map"
        position = {**self._position.to_dict(kind), **self._data_layout()}
        return {
            **self.state.preemptible,
            **timings_record(
                self.step_timer,
                self.save_timer,
                self.sigterm_to_exit,
                jit_elapsed=elapsed,
                micro_batch_timer=self.micro_batch_timer,
            ),
            "data_position": position,
            # how this save was written: its time (the manifest's) is a JIT estimate only when
            # it blocked training, not for a background write
            "save_kind": "jit" if jit else ("background" if background else "blocking"),
            # the longest post-commit work so far: the next attempt's exit reserve starts there
            "post_commit_seconds": self._post_commit_seconds,
        }

    def _data_layout(self) -> dict[str, Any]:
        """What the meaning of a data position depends on (checked on resume)."""
        args = self.args
        layout: dict[str, Any] = {
            "batch_size": per_rank_batch_size(args, collectives.world_size()),
            "world_size": collectives.world_size(),
            "data_seed": self._data_seed(),
        }
        if self.train_sampler is not None:
            layout["strategy"] = args.train_sampling_strategy
        elif self._dispatch:
            # Iterable: one split stream, not one stream per rank (key absent: not dispatched).
            layout["dispatch_batches"] = True
        if not even_batches(args):
            # Without wrap-around the ranks' shares differ from a padded run's (absent: True).
            layout["even_batches"] = False
        return layout

    def save_checkpoint(self, jit: bool = False) -> CheckpointInfo:
        """Write ``checkpoint-<global_step>`` (all ranks); a step is never saved twice.

        With save_async a periodic save (``jit=False``) only snapshots the state and returns the
        in-flight checkpoint (incomplete until committed at a later step boundary); a JIT save
        first settles a write in flight (waits for it when it is of this step, else cancels it)
        and the time that takes counts as part of the JIT save's measured time
        (:meth:`CheckpointManager.save`)."""
        return self._checkpoints.save(jit)

    def _checkpoint_entries(
        self, main: bool, jit: bool, *, snapshot: bool = False
    ) -> list[tuple[str, Any, bool]]:
        """The files of a checkpoint, in write order (CheckpointManager.entries)."""
        return self._checkpoints.entries(main, jit, snapshot=snapshot)

    def _after_checkpoint_commit(
        self, info: CheckpointInfo, seconds: float, *, blocking: bool = True
    ) -> None:
        """Every rank, once a checkpoint is committed: timings, rotation, on_save.
        ``blocking=False``: a background write (it does not set the JIT save estimate). The time
        this takes is measured: the exit reserve of a JIT stop keeps it back (deadline.py)."""
        post_commit = time.perf_counter()
        self.save_timer.record(seconds, blocking=blocking)
        self.last_checkpoint = info
        logger.info("saved %s in %.3f s", info.path, self.save_timer.last or 0.0)
        # save_total_limit keeps the best checkpoint too; save_strategy="best" drops stale bests.
        for path in self._rotate_after_save(info):
            logger.info("rotated out %s (save_total_limit=%s)", path, self.args.save_total_limit)
        collectives.barrier()
        pending = self.control.should_save
        self._event("on_save", checkpoint=info.path)  # clears should_save, as in transformers
        if info.step != self.state.global_step:
            # a background checkpoint of an earlier step, committed now: its on_save must not
            # consume this step's own save
            self.control.should_save = pending
        self._publish_metrics()
        self._record_post_commit(time.perf_counter() - post_commit)

    # -- the checkpoint manager's state (read by tests and benchmarks) ----------------------------
    @property
    def _async_save(self) -> BackgroundSave | None:
        """The periodic checkpoint a writer thread is writing (save_async), or None."""
        return self._checkpoints.in_flight

    @property
    def _pinned_staging(self) -> PinnedStaging:
        return self._checkpoints.staging

    @property
    def _snapshot_buffers(self) -> SnapshotBuffers:
        return self._checkpoints.snapshot_buffers

    def _processing_class_to_save(self) -> Any:
        """The processing class, else the data collator's tokenizer (as transformers saves)."""
        if self.processing_class is not None:
            return self.processing_class
        return getattr(self.data_collator, "tokenizer", None)

    def save_state(self) -> None:
        """Write trainer_state.json (the TrainerState) to args.output_dir, on the main process
        (save_model() does not write it)."""
        if not self.is_world_process_zero():
            return
        state = self.state.to_dict()
        state.pop(PREEMPTIBLE_KEY, None)  # transformers' fields only, as in a checkpoint
        storage = Storage(str(self.args.output_dir))
        storage.makedirs("")
        storage.write_json(TRAINER_STATE_NAME, state)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> str | None:
        """Write the model as transformers' ``save_model`` does (``from_pretrained`` opens a
        PreTrainedModel's or PEFT adapter's directory; other modules: model.safetensors), the
        processing class's files and training_args.json to ``output_dir`` (default:
        args.output_dir). Not a checkpoint: nothing to resume from. Returns the directory on the
        main process, None elsewhere."""
        target = output_dir or str(self.args.output_dir)
        # fsdp: every rank takes part in gathering the full weights; the main process writes them.
        gathered = self._gathered_model_tensors()
        wrote = self._checkpoints.save_model(target, gathered)
        self._push_after_save_model(_internal_call)
        return target if wrote else None

    def _push_after_save_model(self, internal: bool) -> None:
        # As transformers: a user's save_model() with push_to_hub also pushes (every rank
        # calls it: push_to_hub saves again, collectively). features/hub.py.
        if self.args.push_to_hub and not internal:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    # -- batch sizes and parallelism ---------------------------------------------------------------
    def get_tp_size(self) -> int:
        """Tensor-parallel degree: 1 (this runtime refuses tensor parallelism)."""
        return int(getattr(self.model, "_tp_size", None) or 1)

    def get_cp_size(self) -> int:
        """Context-parallel degree: 1 (parallelism_config is refused)."""
        return 1

    def get_sp_size(self) -> int:
        """Sequence-parallel degree: 1 (parallelism_config is refused)."""
        return 1

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        world = collectives.world_size()
        data_parallel = world // self.get_tp_size() // self.get_cp_size() // self.get_sp_size()
        per_rank = per_rank_batch_size(args, world)
        return per_rank * args.gradient_accumulation_steps * max(data_parallel, 1)

    def set_initial_training_values(
        self, args: TrainingArguments, dataloader: DataLoader
    ) -> tuple[int, int, int, int, int, int | None, int]:
        """transformers' plan of a run: (num_train_epochs, update steps per epoch, examples,
        train samples, total train batch size, micro-batches per epoch, max_steps). Our loop
        plans with the same arithmetic (``_plan_steps``); this reports it for ``dataloader``."""
        ga = args.gradient_accumulation_steps
        total_batch = self.get_total_train_batch_size(args)
        try:
            length: int | None = len(dataloader)
        except TypeError:
            length = None
        max_steps = args.max_steps
        if length:
            per_epoch = max(math.ceil(length / ga), 1)
            if max_steps <= 0:
                max_steps = math.ceil(args.num_train_epochs * per_epoch)
                epochs = math.ceil(args.num_train_epochs)
                samples = self.num_examples(dataloader) * args.num_train_epochs
            else:
                epochs = math.ceil(max_steps / per_epoch)
                samples = max_steps * total_batch
            return (
                epochs,
                per_epoch,
                self.num_examples(dataloader),
                samples,
                total_batch,
                length,
                max_steps,
            )
        if max_steps > 0:
            return (
                sys.maxsize,
                max_steps,
                total_batch * max_steps,
                total_batch * max_steps,
                total_batch,
                max_steps * ga,
                max_steps,
            )
        raise ConfigurationError(
            f"max_steps={max_steps} with a train dataloader without a length: set max_steps to "
            "the number of optimizer steps to train"
        )

    def get_resumed_dataloader(self, dataloader: DataLoader, num_batches: int) -> DataLoader:
        """A DataLoader that skips its first ``num_batches`` batches (accelerate's
        ``skip_first_batches``), as transformers' Trainer returns it. Our loop restores a
        mid-epoch position through its resumable sampler (no batch is read twice) and skips
        the batches of a custom loader itself; this method is for subclasses and scripts."""
        from accelerate import skip_first_batches

        return skip_first_batches(dataloader, num_batches)  # type: ignore[no-any-return]

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | None]:
        """Up to ``num_batches`` batches from ``epoch_iterator`` and the label tokens they hold
        (``num_items_in_batch``; None when the loss does not need it). Our loop reads its
        micro-batches itself (it tracks the data position for exact resume); this helper is
        for subclasses and scripts."""
        batches: list[Any] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        num_items = losses.count_items_in_batch(
            batches,
            shift_labels=losses.is_causal_lm(self.model),
            label_name=self.label_names[0],
            across_ranks=self.args.average_tokens_across_devices and collectives.is_distributed(),
        )
        items = self._loss_num_items(num_items)
        return batches, None if items is None else items.to(device)

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def _load_checkpoint(self, info: CheckpointInfo) -> None:
        """Restore model, optimizer, scheduler, RNG, state and data position from ``info``
        (checkpointing.py; the progress and data position through the two hooks below)."""
        self._checkpoints.load(info)

    def _restore_progress(
        self, state: dict[str, Any], record: dict[str, Any], info: CheckpointInfo
    ) -> None:
        """A checkpoint's progress and timings (its trainer_state.json and our record), applied
        while it is loaded."""
        restored = TrainerState.from_dict(state)
        # Keep this run's plan (max_steps may have been raised), take the progress from the file.
        self.state.global_step = restored.global_step
        self.state.epoch = restored.epoch
        self.state.log_history = restored.log_history
        self.state.num_input_tokens_seen = restored.num_input_tokens_seen
        self.state.total_flos = restored.total_flos
        self.state.best_metric = restored.best_metric
        self.state.best_global_step = restored.best_global_step
        self.state.best_model_checkpoint = restored.best_model_checkpoint
        self.state.stateful_callbacks = restored.stateful_callbacks
        self.state.preemptible = record
        self.step_timer.load(record.get("step_seconds"))
        self.save_timer.load(record.get("save_seconds"))
        self.micro_batch_timer.load(record.get("micro_batch_seconds"))
        post_commit = record.get("post_commit_seconds")
        if isinstance(post_commit, int | float) and not isinstance(post_commit, bool):
            self._record_post_commit(float(post_commit))
        if info.save_seconds is not None:
            # our record is written before its own save is timed; the manifest knows.
            blocking = record.get("save_kind") != "background"
            self.save_timer.record(info.save_seconds, blocking=blocking)
        self.sigterm_to_exit = [float(x) for x in record.get("sigterm_to_exit_seconds") or []]

    def _restore_data_position(
        self, record: dict[str, Any], info: CheckpointInfo
    ) -> tuple[int, int]:
        """A checkpoint's data position, re-sharded to this run's layout; returns (epoch, batch
        of the epoch)."""
        position = record.get("data_position") or self._position_from_step()
        layout = self._data_layout()
        # A new number of ranks or batch size is re-sharded exactly or refused (resharding.py).
        saved_shape = DataShape(
            int(position.get("world_size") or (info.manifest or {}).get("world_size") or 1),
            int(position.get("batch_size") or layout["batch_size"]),
        )
        batch = reshard_position(
            int(position.get("batch", 0)),
            saved_shape,
            DataShape(layout["world_size"], layout["batch_size"]),
            # A dispatched stream is one sequence of global batches: it re-shards like map-style.
            map_style=self.train_sampler is not None
            or (self._dispatch and bool(position.get("dispatch_batches"))),
            ignore_data_skip=self.args.ignore_data_skip,
            path=info.path,
        )
        changed = {
            key: (position[key], value)
            for key, value in layout.items()
            if key in position
            and position[key] != value
            and key not in ("world_size", "batch_size")
        }
        for key, default in (("even_batches", True), ("dispatch_batches", False)):
            # Recorded only when not the default: compare with the default filled in.
            old, new = position.get(key, default), layout.get(key, default)
            if old != new and (key == "even_batches" or self.train_sampler is None):
                changed[key] = (old, new)
        if saved_shape != DataShape(layout["world_size"], layout["batch_size"]):
            logger.warning(
                "%s was saved by %d rank(s) x %d samples, this run has %d x %d: data position "
                "re-sharded from batch %d to batch %d of the epoch (same samples consumed)",
                info.path,
                saved_shape.world_size,
                saved_shape.batch_size,
                layout["world_size"],
                layout["batch_size"],
                int(position.get("batch", 0)),
                batch,
            )
        if changed and not self.args.ignore_data_skip:
            logger.warning(
                "the data layout changed since %s was saved (%s): the data position is restored "
                "as a batch count, so the samples seen will differ from an uninterrupted run",
                info.path,
                ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changed.items()),
            )
        self._position.epoch = int(position.get("epoch", int(self.state.epoch or 0)))
        self._position.batch = batch
        self._position.started = bool(position.get("started", False))
        if self._num_batches is not None and self._position.batch >= self._num_batches:
            # Saved right at the end of an epoch (its end was already handled): next epoch.
            self._position.epoch += 1
            self._position.batch = 0
            self._position.started = False
        return self._position.epoch, self._position.batch

    def _load_callback_state(self) -> None:
        """restore_callback_states_from_checkpoint: rebuild each stateful callback (and the
        TrainerControl) from trainer_state.json's ``stateful_callbacks``, as transformers does:
        ``type(cb)(**args)`` with the saved ``attributes`` set on it. A rebuilt callback keeps its
        place in the callback list."""
        if not self.args.restore_callback_states_from_checkpoint:
            return
        callbacks = self.callback_handler.callbacks
        missing: list[str] = []
        for name, saved in self.state.stateful_callbacks.items():
            entries = saved if isinstance(saved, list) else [saved]
            if name == type(self.control).__name__:
                self.control = self._rebuilt(type(self.control), entries[0])
                continue
            indices = [i for i, cb in enumerate(callbacks) if type(cb).__name__ == name]
            if not indices:
                missing.append(name)
                continue
            # Several callbacks of one class: matched in order, as they were saved.
            for index, entry in zip(indices, entries, strict=False):
                callbacks[index] = self._rebuilt(type(callbacks[index]), entry)
            logger.info("restored the state of callback %s from the checkpoint", name)
        if missing:
            logger.warning(
                "the checkpoint holds the state of callbacks this Trainer does not have, ignored: "
                "%s",
                ", ".join(missing),
            )

    @staticmethod
    def _rebuilt(cls: type, entry: Mapping[str, Any]) -> Any:
        try:
            rebuilt = cls(**dict(entry.get("args") or {}))
        except TypeError as exc:
            raise ResumeError(
                f"restore_callback_states_from_checkpoint: cannot rebuild {cls.__name__} from the "
                f"saved args {entry.get('args')!r}: {exc}; set "
                "restore_callback_states_from_checkpoint=False"
            ) from None
        for attribute, value in (entry.get("attributes") or {}).items():
            setattr(rebuilt, attribute, value)
        return rebuilt

    def _position_from_step(self) -> dict[str, Any]:
        """The data position of a checkpoint without our record (transformers.Trainer's): derived
        from the global step as transformers does on resume (whole epochs of ceil(batches /
        gradient_accumulation_steps) steps, then that many micro-batches into the next)."""
        args, step = self.args, self.state.global_step
        ga = args.gradient_accumulation_steps
        per_epoch = math.ceil(self._num_batches / ga) if self._num_batches else self.state.max_steps
        per_epoch = max(per_epoch, 1)
        position = {"epoch": step // per_epoch, "batch": (step % per_epoch) * ga}
        if self._num_batches is not None:
            position["batch"] = min(position["batch"], self._num_batches)
        return position

    # -- reporting ---------------------------------------------------------------------------------
    def _publish_metrics(self) -> None:
        if self.metrics is None:
            return
        self.metrics.update(
            step=self.state.global_step,
            max_steps=self.state.max_steps,
            epoch=self.state.epoch,
            step_seconds=self.step_timer.to_model(),
            save_seconds=self.save_timer.to_model(),
            micro_batch_seconds=self.micro_batch_timer.to_model(),
            last_complete_checkpoint_step=self.last_checkpoint.step
            if self.last_checkpoint
            else None,
            stop_requested=bool(self.sigterm_latch and self.sigterm_latch.triggered),
        )
        for key, value in self._checkpoints.staging.metrics().items():
            self.metrics.set(key, value)

    def _write_termination(
        self,
        reason: str,
        *,
        message: str | None = None,
        sigterm_to_exit: float | None = None,
        failed_rank: int | None = None,
        peer_gone: bool = False,
    ) -> None:
        # One message per pod: its main process (local rank 0) writes it, so every pod of a
        # multi-node attempt knows how its workers ended; under `trainer-runtime launch` every
        # worker writes its own file, which the launcher merges into the pod's message.
        if not (self.accelerator.is_local_main_process or os.environ.get(ENV_TERMINATION_DIR)):
            return
        no_save = reason == REASON_DEADLINE_TOO_SHORT
        write_termination(
            reason,
            step=self.state.global_step,
            # Nothing was written: the message names no checkpoint (the operator reads storage).
            checkpoint=None if no_save else self.last_checkpoint,
            step_timer=self.step_timer,
            save_timer=self.save_timer,
            sigterm_to_exit=sigterm_to_exit,
            message=message,
            micro_batch_timer=self.micro_batch_timer,
            stop=self._jit_stop_kind if self.preempted else None,
            failed_rank=failed_rank,
            peer_gone=peer_gone or None,
            resumed_from=getattr(self, "_resumed_from", None),
        )
