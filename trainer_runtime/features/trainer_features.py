"""Trainer methods for evaluation, prediction, best-model tracking, reporting and precision.

:class:`TrainerFeaturesMixin` is a base class of :class:`trainer_runtime.trainer.Trainer`. It adds
``evaluate``, ``predict``, ``evaluation_loop``, ``prediction_step``, ``get_eval_dataloader``,
``get_test_dataloader``, ``log_metrics``, ``save_metrics``, ``metrics_format`` and
``autocast_smart_context_manager``, and hooks the core loop calls at a few points:

* ``_init_features()`` at the end of ``__init__`` (validates, sets up precision, adds the
  reporting, progress and evaluation-flow callbacks); ``_maybe_compile(model)`` on the prepared
  model; ``autocast_smart_context_manager()`` around the forward pass;
* ``_evaluate_during_training()`` when ``control.should_evaluate`` is set (between logging and
  saving), and at the start of training when ``eval_on_start``;
* ``_before_checkpoint_write()`` / ``_rotate_after_save(info)`` around a save;
* ``_load_best_model_at_end()`` after the loop;
* ``_count_tokens(batches)`` / ``_after_optimizer_step()`` in the training step.

It relies on these Trainer attributes: ``args``, ``model``, ``model_wrapped``, ``accelerator``,
``state``, ``control``, ``callback_handler``, ``data_collator``, ``eval_dataset``,
``compute_metrics``, ``compute_loss``, ``compute_loss_func``, ``label_names``, ``log``,
``_event``, ``_prepare_inputs``, ``_model_accepts_loss_kwargs``, ``_loss_num_items``,
``_model_input_name``, ``last_checkpoint``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.data import length_sampling
from trainer_runtime.data.columns import (
    RemoveColumnsCollator,
    is_hf_dataset,
    remove_unused_columns,
)
from trainer_runtime.data.worker_signals import shield_dataloader
from trainer_runtime.distributed import collectives
from trainer_runtime.distributed.ddp_args import even_batches
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features import losses
from trainer_runtime.features.best import (
    best_rotation_victims,
    metric_key,
    update_best,
)
from trainer_runtime.features.evaluation import (
    EvalLoopOutput,
    UnevenEvalBatchSampler,
    UnevenGather,
    default_ignore_keys,
    evaluation_loop,
    prediction_step,
    should_evaluate_at_epoch_end,
    should_evaluate_at_step,
)
from trainer_runtime.features.logging_utils import (
    apply_log_level,
    count_input_tokens,
    log_metrics,
    metrics_format,
    normalize_tokens_seen_mode,
    process_log_level,
    resolve_interval,
    save_metrics,
    speed_metrics,
)
from trainer_runtime.features.losses import LabelSmoother
from trainer_runtime.features.optim import is_metric_driven
from trainer_runtime.features.precision import (
    autocast_context,
    empty_device_cache,
    enable_activation_checkpointing,
    eval_dtype,
    maybe_compile,
    resolve_activation_checkpointing,
    set_tf32,
    should_empty_cache,
    validate_precision,
)
from trainer_runtime.features.progress import progress_callback, resolve_disable_tqdm
from trainer_runtime.features.trackers import reporting_callbacks
from trainer_runtime.state import TrainerControl, TrainerState
from trainer_runtime.trainer_utils import PredictionOutput

__all__ = ["EvaluationFlowCallback", "TrainerFeaturesMixin"]

logger = logging.getLogger(__name__)


class EvaluationFlowCallback(TrainerCallback):
    """Sets ``control.should_evaluate`` per ``eval_strategy`` / ``eval_steps`` / ``eval_delay``
    (the evaluation half of Hugging Face's default flow), and resolves ``state.eval_steps``."""

    def on_train_begin(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        if getattr(args, "eval_strategy", "no") == "steps" and args.eval_steps is not None:
            state.eval_steps = resolve_interval(args.eval_steps, state.max_steps)

    def on_step_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        strategy = getattr(args, "eval_strategy", "no")
        if should_evaluate_at_step(strategy, state.global_step, state.eval_steps, args.eval_delay):
            control.should_evaluate = True
        elif (
            strategy == "steps"
            and state.max_steps > 0
            and state.global_step >= state.max_steps
            and state.global_step >= args.eval_delay
        ):
            # The last step is evaluated too when it is not a multiple of eval_steps, so the
            # final model always has eval metrics (as transformers does).
            control.should_evaluate = True
        return control

    def on_epoch_end(
        self, args: Any, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> Any:
        strategy = getattr(args, "eval_strategy", "no")
        if should_evaluate_at_epoch_end(strategy, float(state.epoch or 0.0), args.eval_delay):
            control.should_evaluate = True
        return control


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class TrainerFeaturesMixin:
    # Set by the Trainer; declared for readers and type checkers.
    args: Any
    model: torch.nn.Module
    model_wrapped: torch.nn.Module
    accelerator: Any
    state: TrainerState
    control: TrainerControl
    callback_handler: Any
    data_collator: Callable[[list[Any]], Any]
    eval_dataset: Any
    compute_metrics: Callable[..., dict[str, float]] | None
    label_names: list[str]
    last_checkpoint: Any
    log: Callable[[dict[str, float]], None]
    _event: Callable[..., None]
    _prepare_inputs: Callable[[Any], Any]
    compute_loss: Callable[..., Any]
    compute_loss_func: Callable[..., Any] | None
    _model_accepts_loss_kwargs: Callable[[], bool]
    _loss_num_items: Callable[[int | None], torch.Tensor | None]
    _model_input_name: Callable[[], str | None]

    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None
    label_smoother: LabelSmoother | None = None
    is_in_train: bool = False
    # What eval_loss averages: every sample once; Seq2SeqTrainer: every batch once (as theirs).
    _eval_loss_weighting: Literal["sample", "batch"] = "sample"

    # -- setup ---------------------------------------------------------------------------------
    def _init_features(
        self, preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None
    ) -> None:
        args = self.args
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        device = self.accelerator.device
        validate_precision(bf16=args.bf16, fp16=args.fp16, device=device)
        set_tf32(args.tf32)
        enabled, ckpt_kwargs = resolve_activation_checkpointing(
            args.activation_checkpointing, args.activation_checkpointing_kwargs, None, None
        )
        if enabled:
            enable_activation_checkpointing(self.model, ckpt_kwargs)
        self._apply_use_cache()
        self.label_smoother = (
            LabelSmoother(args.label_smoothing_factor) if args.label_smoothing_factor else None
        )
        runtime_logger = logging.getLogger("trainer_runtime")
        level = process_log_level(
            args.log_level,
            args.log_level_replica,
            process_index=collectives.rank(),
            local_process_index=self.accelerator.local_process_index,
            log_on_each_node=args.log_on_each_node,
        )
        if level is not None:  # "passive" leaves the logging configuration alone
            apply_log_level(level)
        self._check_eval_setup()
        for callback in reporting_callbacks(args.report_to):
            self.callback_handler.add_callback(callback)
        disable = resolve_disable_tqdm(args.disable_tqdm, runtime_logger.getEffectiveLevel())
        progress = progress_callback(disable)
        if not any(isinstance(cb, progress) for cb in self.callback_handler.callbacks):
            self.callback_handler.add_callback(progress)
        self.callback_handler.add_callback(EvaluationFlowCallback())

    def _apply_use_cache(self) -> None:
        """As transformers: ``model.config.use_cache = args.use_cache`` (False unless asked), so
        training builds no KV cache and evaluation outputs carry none."""
        config = getattr(self.model, "config", None)
        # A plain dict "config" of a custom model is not a transformers config: leave it alone.
        if config is not None and not isinstance(config, Mapping):
            config.use_cache = bool(self.args.use_cache)

    def _check_eval_setup(self) -> None:
        args = self.args
        if args.eval_strategy != "no" and self.eval_dataset is None:
            raise ConfigurationError(
                f"eval_strategy={args.eval_strategy!r} needs an eval_dataset: pass "
                "eval_dataset=... to the Trainer or set eval_strategy='no'"
            )
        if args.eval_on_start and self.eval_dataset is None:
            raise ConfigurationError("eval_on_start=True needs an eval_dataset")
        if args.batch_eval_metrics:
            if self.compute_metrics is None:
                raise ConfigurationError(
                    "batch_eval_metrics=True needs compute_metrics(eval_pred, compute_result)"
                )
            if not _accepts(self.compute_metrics, "compute_result"):
                raise ConfigurationError(
                    "batch_eval_metrics=True calls compute_metrics(eval_pred, compute_result=...): "
                    "add a compute_result argument to your compute_metrics"
                )

    def _maybe_compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """``torch.compile`` the (prepared) model when ``torch_compile`` is on."""
        return maybe_compile(
            model,
            torch_compile=self.args.torch_compile,
            backend=self.args.torch_compile_backend,
            mode=self.args.torch_compile_mode,
        )

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """Autocast for bf16/fp16 (a no-op context otherwise); ``cache_enabled`` as in
        ``torch.autocast``."""
        return autocast_context(
            bf16=self.args.bf16,
            fp16=self.args.fp16,
            device=self.accelerator.device,
            cache_enabled=cache_enabled,
        )

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """The contexts compute_loss() runs in (training_step and prediction_step enter it):
        autocast. Override to add your own."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.autocast_smart_context_manager())
        return stack

    # -- dataloaders -----------------------------------------------------------------------------
    def _drop_unused_columns(self, dataset: Any, keep: list[str] | None = None) -> Any:
        """``dataset`` without the columns forward() does not take, when it is a
        ``datasets.Dataset`` and ``remove_unused_columns`` is set; other datasets are filtered per
        batch (``_prepare_inputs``)."""
        if not self.args.remove_unused_columns:
            return dataset
        return remove_unused_columns(
            dataset, self.model, label_names=self.label_names, keep=keep or ()
        )

    def _collator_for(self, dataset: Any) -> Callable[[list[Any]], Any]:
        """The collator for ``dataset``: as transformers, a dataset that is not a
        ``datasets.Dataset`` (whose columns are removed up front) has each example's fields that
        forward() does not take dropped before collation, when ``remove_unused_columns`` is set."""
        if not self.args.remove_unused_columns or is_hf_dataset(dataset):
            return self.data_collator
        return RemoveColumnsCollator(self.data_collator, self.model, label_names=self.label_names)

    def _eval_loader(self, dataset: Dataset[Any]) -> DataLoader[Any]:
        if (
            collectives.is_distributed()
            and not even_batches(self.args)
            and isinstance(dataset, Sized)
        ):
            # even_batches=False: no sample twice; UnevenGather drops the pads' rows.
            return DataLoader(
                self._drop_unused_columns(dataset),
                batch_sampler=UnevenEvalBatchSampler(
                    len(dataset),
                    self.args.per_device_eval_batch_size,
                    world_size=collectives.world_size(),
                    rank=collectives.rank(),
                    drop_last=self.args.dataloader_drop_last,
                ),
                collate_fn=self._collator_for(dataset),
                num_workers=self.args.dataloader_num_workers,
            )
        order: list[int] | None = None
        if self.args.train_sampling_strategy == "group_by_length" and isinstance(dataset, Sized):
            # transformers length-groups evaluation and prediction batches too under this
            # strategy (seeded by data_seed/seed): the same batches, so the same eval_loss.
            lengths = length_sampling.infer_lengths(
                dataset,
                length_column_name=self.args.length_column_name,
                model_input_name=self._model_input_name(),
            )
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            order = length_sampling.eval_length_grouped_order(
                lengths, self.args.per_device_eval_batch_size, seed=seed
            )
        loader = DataLoader(
            self._drop_unused_columns(dataset),
            batch_size=self.args.per_device_eval_batch_size,
            shuffle=False,
            sampler=order,
            collate_fn=self._collator_for(dataset),
            num_workers=self.args.dataloader_num_workers,
            drop_last=self.args.dataloader_drop_last,
        )
        if collectives.is_distributed():
            # Shards batches over ranks; gather_for_metrics drops the padding duplicates.
            loader = self.accelerator.prepare_data_loader(loader)
        return loader

    def get_eval_dataloader(self, eval_dataset: str | Dataset[Any] | None = None) -> DataLoader:
        if isinstance(eval_dataset, str):
            if not isinstance(self.eval_dataset, dict) or eval_dataset not in self.eval_dataset:
                raise ConfigurationError(
                    f"get_eval_dataloader({eval_dataset!r}) needs eval_dataset to be a dict with "
                    "that key"
                )
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigurationError("evaluation requires an eval_dataset")
        return self._eval_loader(dataset)

    def get_test_dataloader(self, test_dataset: Dataset[Any]) -> DataLoader:
        return self._eval_loader(test_dataset)

    # -- the prediction loop ---------------------------------------------------------------------
    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Any, Any, Any]:
        def loss_fn(m: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, Any]:
            num_items = self._eval_num_items(batch)
            if num_items is None or not _accepts(self.compute_loss, "num_items_in_batch"):
                return self.compute_loss(m, dict(batch), return_outputs=True)
            return self.compute_loss(
                m, dict(batch), return_outputs=True, num_items_in_batch=num_items
            )

        if ignore_keys is None:
            ignore_keys = default_ignore_keys(self.model)
        return prediction_step(
            model,
            inputs,
            prediction_loss_only=prediction_loss_only,
            label_names=self.label_names,
            ignore_keys=ignore_keys,
            loss_fn=loss_fn,
            autocast=self.compute_loss_context_manager(),
        )

    def _eval_num_items(self, batch: Any) -> torch.Tensor | None:
        """``num_items_in_batch`` for one evaluation batch, as transformers 5.x passes it to a
        model that takes loss kwargs (or to ``compute_loss_func``): the batch's label tokens,
        shifted for causal LMs, so the model's summed loss is divided by the same count as in
        training; a tensor on the device, as in training (``_loss_num_items``). With
        ``average_tokens_across_devices`` over several ranks it is left out (each rank's loss is
        then its own mean; see docs/trainer.md, differences from transformers)."""
        uses_count = self.compute_loss_func is not None or self._model_accepts_loss_kwargs()
        if not uses_count or not isinstance(batch, Mapping):
            return None
        if self.args.average_tokens_across_devices and collectives.is_distributed():
            return None
        count = losses.count_items_in_batch(
            [batch], shift_labels=losses.is_causal_lm(self.model), label_name=self.label_names[0]
        )
        return self._loss_num_items(count)

    def _fire(self, event: str, **kwargs: Any) -> None:
        """Call ``event`` on the callbacks that define it (for events the handler may lack)."""
        handler = self.callback_handler
        for callback in handler.callbacks:
            method = getattr(callback, event, None)
            if method is not None:
                result = method(self.args, self.state, self.control, **handler.objects, **kwargs)
                if result is not None:
                    self.control = result

    def evaluation_loop(
        self,
        dataloader: Iterable[Any],
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        args = self.args
        loss_only = (
            args.prediction_loss_only
            if prediction_loss_only is None
            else bool(prediction_loss_only)
        )
        model = self.model_wrapped if self.is_in_train else self.model
        dtype = eval_dtype(bf16_full_eval=args.bf16_full_eval, fp16_full_eval=args.fp16_full_eval)
        if dtype is not None and not self.is_in_train:
            model = model.to(dtype=dtype)
        logger.debug("%s: batch size %d", description, args.per_device_eval_batch_size)
        was_training = model.training

        def step(m: torch.nn.Module, batch: Any) -> tuple[Any, Any, Any]:
            return self.prediction_step(m, batch, loss_only, ignore_keys)

        gather: Callable[[Any], Any] = (
            self.accelerator.gather_for_metrics if collectives.is_distributed() else lambda x: x
        )
        uneven = getattr(dataloader, "batch_sampler", None)
        if isinstance(uneven, UnevenEvalBatchSampler):
            gather = UnevenGather(
                uneven,
                gather=self.accelerator.gather,
                pad_across_processes=self.accelerator.pad_across_processes,
                device=self.accelerator.device,
            )
        try:
            return evaluation_loop(
                model,
                dataloader,
                prepare=self._prepare_inputs,
                step=step,
                compute_metrics=self.compute_metrics,
                preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
                eval_accumulation_steps=args.eval_accumulation_steps,
                eval_do_concat_batches=args.eval_do_concat_batches,
                include_for_metrics=args.include_for_metrics,
                batch_eval_metrics=args.batch_eval_metrics,
                metric_key_prefix=metric_key_prefix,
                nan_inf_filter=args.logging_nan_inf_filter,
                loss_weighting=self._eval_loss_weighting,
                gather=gather,
                on_prediction_step=lambda: self._on_evaluation_batch(dataloader),
                keep_predictions=description == "Prediction",
            )
        finally:
            model.train(was_training)

    def _on_evaluation_batch(self, dataloader: Iterable[Any]) -> None:
        self._fire("on_prediction_step", eval_dataloader=dataloader)
        # The Trainer's JIT stop may abandon an evaluation during training here (jit_stop.py).
        check = getattr(self, "_check_abandon_evaluation", None)
        if check is not None:
            check()

    def evaluate(
        self,
        eval_dataset: Dataset[Any] | dict[str, Dataset[Any]] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """Evaluate and return the metrics (each of a dict of datasets: ``<prefix>_<name>_*``)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            metrics: dict[str, float] = {}
            for name, one in dataset.items():
                metrics.update(
                    self.evaluate(one, ignore_keys, metric_key_prefix=f"{metric_key_prefix}_{name}")
                )
            return metrics
        loader = self.get_eval_dataloader(dataset)
        output = self._timed_loop(loader, "Evaluation", ignore_keys, metric_key_prefix)
        self.log(output.metrics)
        self._event("on_evaluate", metrics=output.metrics)
        return output.metrics

    def _timed_loop(
        self, loader: Any, description: str, ignore_keys: list[str] | None, prefix: str
    ) -> Any:
        """The evaluation loop plus the HF speed metrics (runtime, samples and steps per second)."""
        started = time.time()
        # shielded here so that an overridden get_eval/test_dataloader()'s loader is too
        loader = shield_dataloader(loader)
        output = self.evaluation_loop(
            loader, description, ignore_keys=ignore_keys, metric_key_prefix=prefix
        )
        batch_size = self.args.per_device_eval_batch_size * collectives.world_size()
        output.metrics.update(
            speed_metrics(
                prefix,
                started,
                num_samples=output.num_samples,
                num_steps=math.ceil(output.num_samples / batch_size),
            )
        )
        return output

    def predict(
        self,
        test_dataset: Dataset[Any],
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> PredictionOutput:
        """Predictions (numpy, right-padded with -100), label ids, and metrics when labelled."""
        loader = self.get_test_dataloader(test_dataset)
        output = self._timed_loop(loader, "Prediction", ignore_keys, metric_key_prefix)
        self._event("on_predict", metrics=output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, output.metrics)

    # -- during training -------------------------------------------------------------------------
    def _evaluate_during_training(self, skip_scheduler: bool = False) -> dict[str, float]:
        """Evaluate, step a metric-driven schedule (not for eval_on_start), update the best
        metric, and with save_strategy='best' ask for a save."""
        was = self.is_in_train
        self.is_in_train = True
        try:
            metrics = self.evaluate(ignore_keys=getattr(self, "_ignore_keys_for_eval", None))
        finally:
            self.is_in_train = was
        self.control.should_evaluate = False
        if not skip_scheduler:
            self._step_metric_schedule(metrics)
        metric = self.args.metric_for_best_model
        if metric is not None:
            is_new, best = update_best(
                metrics,
                best_metric=self.state.best_metric,
                metric_for_best_model=metric,
                greater_is_better=self.args.greater_is_better,
            )
            if is_new:
                self.state.best_metric = best
                self.state.best_global_step = self.state.global_step
            if self.args.save_strategy == "best":
                self.control.should_save = is_new
        return metrics

    def _step_metric_schedule(self, metrics: Mapping[str, float]) -> None:
        """reduce_lr_on_plateau / greedy: ``step(metric_for_best_model)`` after an evaluation, as
        transformers does (the loop does not step them per optimizer step)."""
        if not is_metric_driven(getattr(self, "lr_scheduler", None)):
            return
        key = metric_key(self.args.metric_for_best_model or "loss")
        if key not in metrics:
            raise ConfigurationError(
                f"metric_for_best_model={self.args.metric_for_best_model!r}: {key!r} is not among "
                f"the evaluation metrics {sorted(metrics)}, so lr_scheduler_type="
                f"{self.args.lr_scheduler_type!r} cannot be stepped; return it from "
                "compute_metrics or change metric_for_best_model"
            )
        self.lr_scheduler.step(metrics[key])

    def _checkpoint_path(self, step: int) -> str:
        from trainer_runtime.checkpoint.storage import Storage

        return Storage(str(self.args.output_dir)).join(f"checkpoint-{step}")

    def _before_checkpoint_write(self) -> None:
        """Before trainer_state.json is written: the checkpoint being saved is the best one when
        the best metric was reached at this step; callback states go into the state."""
        if (
            self.state.best_global_step is not None
            and self.state.best_global_step == self.state.global_step
        ):
            self.state.best_model_checkpoint = self._checkpoint_path(self.state.global_step)
        # The control's flags too, as transformers saves them (TrainerControl entry).
        for callback in [*self.callback_handler.callbacks, self.control]:
            state_fn = getattr(callback, "state", None)
            if callable(state_fn):
                self.state.stateful_callbacks[type(callback).__name__] = state_fn()

    def _rotation_protect(self) -> tuple[str, ...]:
        best = self.state.best_model_checkpoint
        return (best.rstrip("/").rsplit("/", 1)[-1],) if best else ()

    def _rotate_after_save(self, info: Any) -> list[str]:
        """Rotation after a committed save: save_total_limit keeps the best and the most recent;
        save_strategy='best' removes earlier (stale) best checkpoints."""
        from trainer_runtime.checkpoint.io import rotate_checkpoints
        from trainer_runtime.checkpoint.layout import CheckpointStore
        from trainer_runtime.checkpoint.per_node import is_checkpoint_writer

        args = self.args
        # save_on_each_node: every node rotates its own copies
        if not is_checkpoint_writer(
            args,
            is_main_process=self.accelerator.is_main_process,
            is_local_main_process=self.accelerator.is_local_main_process,
        ):
            return []
        if args.save_total_limit is None and args.save_strategy != "best":
            return []
        protect = {info.name, *self._rotation_protect()}
        if args.save_strategy != "best":
            return rotate_checkpoints(
                str(args.output_dir), args.save_total_limit, protect=tuple(protect)
            )
        names = [c.name for c in CheckpointStore(str(args.output_dir)).list() if c.complete]
        best = self._rotation_protect()
        victims = best_rotation_victims(
            names,
            save_total_limit=args.save_total_limit,
            best_checkpoint=best[0] if best else None,
            save_strategy="best",
            protect=protect,
        )
        if not victims:
            return []
        keep = [n for n in names if n not in victims]
        return rotate_checkpoints(str(args.output_dir), len(keep), protect=tuple(keep))

    def _load_best_model_at_end(self) -> bool:
        """Load the best checkpoint's weights (load_best_model_at_end); False when none."""
        from trainer_runtime.checkpoint.hf_format import load_model_files
        from trainer_runtime.checkpoint.io import CheckpointReader

        path = self.state.best_model_checkpoint
        if not self.args.load_best_model_at_end or not path:
            return False
        reader = CheckpointReader(path)
        # model.safetensors, or a PEFT model's adapter
        load_model_files(self.model, reader.load_bytes, reader.exists, path)
        logger.info(
            "loaded the best model from %s (%s=%s)",
            path,
            metric_key(self.args.metric_for_best_model),
            self.state.best_metric,
        )
        return True

    def _count_tokens(self, batches: Iterable[Any]) -> None:
        """include_num_input_tokens_seen: add this step's input tokens (summed over ranks)."""
        mode = normalize_tokens_seen_mode(self.args.include_num_input_tokens_seen)
        if mode == "no":
            return
        pad = getattr(getattr(self, "processing_class", None), "pad_token_id", None)
        count = sum(count_input_tokens(b, mode, pad_token_id=pad) for b in batches)
        self.state.num_input_tokens_seen += collectives.all_reduce_sum(count)

    def _after_optimizer_step(self) -> None:
        if should_empty_cache(self.state.global_step, self.args.torch_empty_cache_steps):
            empty_device_cache(self.accelerator.device)

    # -- metrics output (Hugging Face helpers) ----------------------------------------------------
    @staticmethod
    def metrics_format(metrics: dict[str, float]) -> dict[str, Any]:
        """``metrics`` formatted for humans (transformers has the same one-argument signature)."""
        return metrics_format(metrics)

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        log_metrics(split, metrics, is_world_process_zero=self.state.is_world_process_zero)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        save_metrics(
            split,
            metrics,
            str(self.args.output_dir),
            combined=combined,
            is_world_process_zero=self.state.is_world_process_zero,
        )

    def num_examples(self, dataloader: DataLoader[Any]) -> int:
        """Samples in ``dataloader``'s dataset (estimated from its batches when unsized)."""
        dataset = getattr(dataloader, "dataset", None)
        if isinstance(dataset, Sized):
            return len(dataset)
        return len(dataloader) * (dataloader.batch_size or 1)
