"""The prediction loop shared by ``Trainer.evaluate`` and ``Trainer.predict``.

Documented behaviour it implements:

* ``preprocess_logits_for_metrics(logits, labels)`` runs once per batch, right after the forward
  pass and before accumulation; what it returns replaces the logits in ``EvalPrediction``.
* Predictions are concatenated on the device; ``eval_accumulation_steps=n`` moves what was
  accumulated to the CPU every ``n`` batches (unset: once, at the end).
* ``eval_do_concat_batches=False`` keeps one entry per batch (lists) instead of concatenating;
  batches of different sequence lengths are otherwise right-padded with -100.
* ``include_for_metrics`` adds ``"inputs"`` and/or ``"loss"`` (per-sample losses) to
  ``EvalPrediction``.
* ``batch_eval_metrics=True`` calls ``compute_metrics(eval_pred, compute_result=...)`` on every
  batch instead of keeping the logits; ``compute_result`` is True on the last batch, and the
  metrics of that call are the result.
* ``prediction_loss_only`` returns only the loss; ``label_names`` says which inputs are labels.
* Metric names get ``<metric_key_prefix>_``; a dict of eval datasets is evaluated one by one with
  ``<prefix>_<name>_`` names.
* ``accelerator_config.even_batches=False`` over several ranks: :class:`UnevenEvalBatchSampler`
  deals the consecutive batches of the set round-robin (no sample twice) and
  :class:`UnevenGather` drops what a rank without a real batch computed, so there is exactly one
  prediction per sample, in dataset order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import Sampler

from trainer_runtime.features.losses import compute_loss

__all__ = [
    "EvalLoopOutput",
    "EvalPrediction",
    "PredictionAccumulator",
    "UnevenEvalBatchSampler",
    "UnevenGather",
    "default_ignore_keys",
    "evaluate_datasets",
    "evaluation_loop",
    "is_kv_cache",
    "nested_concat",
    "nested_numpify",
    "prediction_step",
    "prefix_metrics",
    "should_evaluate_at_epoch_end",
    "should_evaluate_at_step",
    "uneven_eval_batches",
]

PADDING_INDEX = -100

Nested = Any  # a tensor / array, or tuples, lists and dicts of them


class EvalPrediction:
    """What ``compute_metrics`` receives.

    Iterating or indexing yields only the present elements, in the order predictions, label_ids,
    inputs, losses, so ``preds, labels = eval_pred`` works when no extras were asked for.
    """

    def __init__(
        self,
        predictions: Nested,
        label_ids: Nested,
        inputs: Nested | None = None,
        losses: Nested | None = None,
    ) -> None:
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        extras = tuple(x for x in (inputs, losses) if x is not None)
        self.elements: tuple[Any, ...] = (predictions, label_ids, *extras)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.elements)

    def __getitem__(self, idx: int) -> Any:
        if idx < 0 or idx >= len(self.elements):
            raise IndexError("EvalPrediction index out of range")
        return self.elements[idx]

    def __len__(self) -> int:
        return len(self.elements)


class EvalLoopOutput(NamedTuple):
    predictions: Nested | None
    label_ids: Nested | None
    metrics: dict[str, float]
    num_samples: int


# -- nested tensor helpers ---------------------------------------------------------------------


def _map(fn: Callable[[Any], Any], x: Nested) -> Nested:
    if isinstance(x, Mapping):
        return type(x)({k: _map(fn, v) for k, v in x.items()})
    if isinstance(x, (tuple, list)):
        return type(x)(_map(fn, v) for v in x)
    return fn(x)


def nested_detach(x: Nested) -> Nested:
    return _map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, x)


def nested_numpify(x: Nested) -> Nested:
    def to_numpy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16
            t = t.float()
        return t.numpy()

    return _map(to_numpy, x)


def _numel(x: Nested) -> int:
    if isinstance(x, Mapping):
        return sum(_numel(v) for v in x.values())
    if isinstance(x, (tuple, list)):
        return sum(_numel(v) for v in x)
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return int(x.numel() if isinstance(x, torch.Tensor) else x.size)
    return 0


def _pad_concat(a: Any, b: Any, padding_index: int) -> Any:
    """Concatenate on dim 0; when dim 1 differs, right-pad both to the longer one."""
    is_torch = isinstance(a, torch.Tensor)
    if a.ndim <= 1 or a.shape[1:] == b.shape[1:]:
        return torch.cat((a, b), dim=0) if is_torch else np.concatenate((a, b), axis=0)
    if a.shape[2:] != b.shape[2:]:
        raise ValueError(
            f"cannot concatenate predictions of shapes {tuple(a.shape)} and {tuple(b.shape)}: "
            "only dimension 1 may differ between batches; set eval_do_concat_batches=False"
        )
    length = max(a.shape[1], b.shape[1])
    shape = (a.shape[0] + b.shape[0], length, *a.shape[2:])
    if is_torch:
        out = a.new_full(shape, padding_index)
    else:
        out = np.full(shape, padding_index, dtype=np.result_type(a, b))
    out[: a.shape[0], : a.shape[1]] = a
    out[a.shape[0] :, : b.shape[1]] = b
    return out


def nested_concat(a: Nested, b: Nested, padding_index: int = PADDING_INDEX) -> Nested:
    """Concatenate two nested structures of tensors/arrays with the same layout along dim 0."""
    if isinstance(a, Mapping):
        return type(a)({k: nested_concat(a[k], b[k], padding_index) for k in a})
    if isinstance(a, (tuple, list)):
        return type(a)(nested_concat(x, y, padding_index) for x, y in zip(a, b, strict=True))
    if isinstance(a, (torch.Tensor, np.ndarray)):
        if a.ndim == 0:
            a = a.reshape(1)
        if b.ndim == 0:
            b = b.reshape(1)
        return _pad_concat(a, b, padding_index)
    raise TypeError(f"cannot concatenate predictions of type {type(a).__name__}")


class PredictionAccumulator:
    """Accumulates one stream (predictions, labels, inputs or losses) over evaluation batches.

    ``add`` concatenates on the tensor's device; ``to_host`` moves what the device holds to host
    numpy (concatenated, or one entry per batch when ``do_concat`` is False). ``host_transfers``
    and ``peak_device_numel`` make the memory behaviour observable.
    """

    def __init__(self, *, do_concat: bool = True, padding_index: int = PADDING_INDEX) -> None:
        self.do_concat = do_concat
        self.padding_index = padding_index
        self.device_buffer: Nested | list[Nested] | None = None
        self.host: Nested | list[Nested] | None = None
        self.host_transfers = 0
        self.peak_device_numel = 0

    def add(self, value: Nested) -> None:
        if self.do_concat:
            self.device_buffer = (
                value
                if self.device_buffer is None
                else nested_concat(self.device_buffer, value, self.padding_index)
            )
        else:
            self.device_buffer = [*(self.device_buffer or []), value]
        self.peak_device_numel = max(self.peak_device_numel, _numel(self.device_buffer))

    def to_host(self) -> None:
        if self.device_buffer is None:
            return
        moved = nested_numpify(self.device_buffer)
        if not self.do_concat:
            self.host = [*(self.host or []), *moved]
        elif self.host is None:
            self.host = moved
        else:
            self.host = nested_concat(self.host, moved, self.padding_index)
        self.device_buffer = None
        self.host_transfers += 1

    def result(self) -> Nested | None:
        self.to_host()
        return self.host


# -- one batch -----------------------------------------------------------------------------------


def is_kv_cache(value: Any) -> bool:
    """True for a transformers ``Cache`` (``DynamicCache``, ``EncoderDecoderCache``, ...): an
    object holding past keys/values, not a prediction (it cannot be concatenated over batches)."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(value).__mro__
    )


def default_ignore_keys(model: Any) -> list[str]:
    """Output keys left out of predictions when ``ignore_keys`` is None, as transformers does:
    ``model.config.keys_to_ignore_at_inference``, else ``["cache"]`` for a model with a config
    (the KV cache of transformers 5.x outputs), else nothing."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    return list(getattr(config, "keys_to_ignore_at_inference", None) or ["cache"])


def _strip_outputs(outputs: Any, ignore_keys: Sequence[str], has_loss: bool) -> Any:
    if isinstance(outputs, Mapping):
        skip = {*ignore_keys, "loss"}
        logits: Any = tuple(v for k, v in outputs.items() if k not in skip)
    elif isinstance(outputs, (tuple, list)):
        logits = tuple(outputs[1:] if has_loss else outputs)
    else:
        logits = (outputs,)
    # A KV cache under any name (``past_key_values`` of older models, a tuple output with
    # use_cache=True) is never a prediction.
    logits = tuple(v for v in logits if not is_kv_cache(v))
    if len(logits) == 0:
        return None
    return logits[0] if len(logits) == 1 else logits


def prediction_step(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    prediction_loss_only: bool,
    label_names: Sequence[str] = ("labels",),
    ignore_keys: Sequence[str] | None = None,
    loss_fn: Callable[[torch.nn.Module, Mapping[str, Any]], tuple[torch.Tensor, Any]] | None = None,
    autocast: contextlib.AbstractContextManager[Any] | None = None,
) -> tuple[torch.Tensor | None, Nested | None, Nested | None]:
    """One evaluation batch: ``(loss, logits, labels)``, each None when absent.

    The loss is computed when every ``label_names`` key is in the batch. ``loss_fn(model,
    inputs) -> (loss, outputs)`` defaults to :func:`trainer_runtime.features.losses.compute_loss`.
    """
    ignore = list(ignore_keys or ())
    names = list(label_names)
    has_labels = bool(names) and all(inputs.get(n) is not None for n in names)
    labels: Nested | None = None
    if has_labels:
        found = nested_detach(tuple(inputs[n] for n in names))
        labels = found[0] if len(found) == 1 else found
    if loss_fn is None:

        def loss_fn(m: torch.nn.Module, batch: Mapping[str, Any]) -> tuple[torch.Tensor, Any]:
            return compute_loss(m, batch, label_names=names)

    with torch.no_grad(), autocast or contextlib.nullcontext():
        if has_labels:
            loss, outputs = loss_fn(model, inputs)
            loss = loss.detach().mean()
        else:
            loss = None
            outputs = model(**{k: v for k, v in inputs.items() if k not in names})
    if prediction_loss_only:
        return loss, None, None
    logits = _strip_outputs(outputs, ignore, has_loss=has_labels)
    return loss, nested_detach(logits), labels


# -- even_batches=False over several ranks ---------------------------------------------------------


def uneven_eval_batches(
    num_samples: int, batch_size: int, world_size: int, rank: int, *, drop_last: bool = False
) -> list[list[int] | None]:
    """This rank's evaluation batches: the set's consecutive batches ``rank``, ``rank +
    world_size``, ... and ``None`` (pad) where the rank has none, so every rank loops equally often.
    """
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"batch_size={batch_size}, world_size={world_size}, rank={rank}: need batch_size >= 1 "
            "and 0 <= rank < world_size"
        )
    stop = num_samples - num_samples % batch_size if drop_last else num_samples
    batches = [list(range(i, min(i + batch_size, stop))) for i in range(0, stop, batch_size)]
    rounds = -(-len(batches) // world_size)
    mine = batches[rank::world_size]
    return [*mine, *([None] * (rounds - len(mine)))]


class UnevenEvalBatchSampler(Sampler[list[int]]):
    """The batches of :func:`uneven_eval_batches`; a pad is one real index (index 0), run only to
    keep the ranks' collectives in step and dropped by :class:`UnevenGather`."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        world_size: int,
        rank: int,
        drop_last: bool = False,
    ) -> None:
        self.batches = uneven_eval_batches(
            num_samples, batch_size, world_size, rank, drop_last=drop_last
        )

    def is_padding(self, index: int) -> bool:
        return 0 <= index < len(self.batches) and self.batches[index] is None

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            yield [0] if batch is None else batch


class UnevenGather:
    """``gather`` for :func:`evaluation_loop` when ranks hold different numbers of rows.

    ``begin_batch(index, rows)`` (called by the loop before each batch's gathers) shares how many
    rows each rank keeps: ``rows``, or 0 for a padding batch. A gather then pads every tensor to
    the longest rank's rows, gathers, and keeps each rank's real rows, in rank order (which is
    dataset order for :class:`UnevenEvalBatchSampler`).
    """

    def __init__(
        self,
        sampler: UnevenEvalBatchSampler,
        *,
        gather: Callable[[Any], Any],
        pad_across_processes: Callable[..., Any],
        device: torch.device,
    ) -> None:
        self.sampler = sampler
        self.gather = gather
        self.pad = pad_across_processes
        self.device = device
        self.counts: list[int] = []

    def begin_batch(self, index: int, rows: int) -> None:
        keep = 0 if self.sampler.is_padding(index) else rows
        counts = self.gather(torch.tensor([keep], dtype=torch.int64, device=self.device))
        self.counts = [int(c) for c in counts.reshape(-1).tolist()]

    def _trim(self, gathered: torch.Tensor) -> torch.Tensor:
        world = len(self.counts)
        if gathered.ndim == 0 or world == 0:
            return gathered
        per_rank = gathered.shape[0] // world
        parts = [gathered[r * per_rank : r * per_rank + self.counts[r]] for r in range(world)]
        return torch.cat(parts, dim=0)

    def __call__(self, value: Nested) -> Nested:
        padded = self.pad(value, dim=0)
        return _map(self._trim, self.gather(padded))


# -- the loop --------------------------------------------------------------------------------------


def _batch_size(inputs: Mapping[str, Any], main_input_name: str) -> int:
    first = inputs.get(main_input_name)
    if first is None:
        first = next((v for v in inputs.values() if isinstance(v, torch.Tensor)), None)
    if isinstance(first, torch.Tensor) and first.ndim > 0:
        return int(first.shape[0])
    return 1


def _with_last(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``. Uses ``len`` when there is one: fetching ahead would make an
    accelerate dataloader report its end one batch early, and ``gather_for_metrics`` would then
    drop samples as padding."""
    try:
        total = len(items)  # type: ignore[arg-type]
    except TypeError:
        yield from _lookahead(items)
        return
    for index, item in enumerate(items):
        yield item, index == total - 1


def _rows(x: Nested) -> int:
    """Leading dimension of the first tensor in a nested structure."""
    if isinstance(x, Mapping):
        return _rows(next(iter(x.values())))
    if isinstance(x, (tuple, list)):
        return _rows(x[0])
    return int(x.shape[0]) if getattr(x, "ndim", 0) > 0 else 1


def _lookahead(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)`` without ``len``, by fetching one item ahead."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current, False
        current = nxt
    yield current, True


def _to_python(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _to_python(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_python(v) for v in value)
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) and np.ndim(value) == 0:
        return value.item()
    return value


def prefix_metrics(metrics: Mapping[str, Any], metric_key_prefix: str) -> dict[str, Any]:
    """Numbers as Python scalars, every key prefixed ``<metric_key_prefix>_`` (once)."""
    out: dict[str, Any] = {}
    for key, value in _to_python(dict(metrics)).items():
        name = key if key.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{key}"
        out[name] = value
    return out


def _flat(values: Nested) -> np.ndarray:
    return (
        np.concatenate([np.atleast_1d(x) for x in values])
        if isinstance(values, list)
        else np.atleast_1d(values)
    ).astype(np.float64)


def _mean_loss(losses: Nested, nan_inf_filter: bool, weights: Nested | None = None) -> float | None:
    values = _flat(losses)
    w = _flat(weights) if weights is not None else np.ones_like(values)
    if nan_inf_filter:
        finite = np.isfinite(values)
        values, w = values[finite], w[finite]
    if values.size == 0 or w.sum() <= 0:
        return None
    return float((values * w).sum() / w.sum())


def evaluation_loop(
    model: torch.nn.Module,
    batches: Iterable[Mapping[str, Any]],
    *,
    step: Callable[[torch.nn.Module, Mapping[str, Any]], tuple[Any, Any, Any]],
    compute_metrics: Callable[..., Mapping[str, Any]] | None = None,
    preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    eval_accumulation_steps: int | None = None,
    eval_do_concat_batches: bool = True,
    include_for_metrics: Sequence[str] = (),
    batch_eval_metrics: bool = False,
    metric_key_prefix: str = "eval",
    main_input_name: str = "input_ids",
    nan_inf_filter: bool = True,
    loss_weighting: Literal["sample", "batch"] = "sample",
    gather: Callable[[Any], Any] = lambda x: x,
    on_prediction_step: Callable[[], None] | None = None,
    keep_predictions: bool = False,
    accumulators: dict[str, PredictionAccumulator] | None = None,
    prepare: Callable[[Any], Mapping[str, Any]] | None = None,
) -> EvalLoopOutput:
    """Run ``step`` (a :func:`prediction_step` with its options bound) over ``batches``.

    ``gather`` collects a tensor from every rank (``accelerator.gather_for_metrics``) in
    distributed evaluation. ``keep_predictions`` keeps predictions even with
    ``batch_eval_metrics`` (``predict`` returns them). A dict passed as ``accumulators`` receives
    the four :class:`PredictionAccumulator` (losses, preds, labels, inputs) for inspection.
    ``prepare`` maps each batch before use (e.g. moves it to the device).
    ``loss_weighting`` says what the mean loss averages: ``"sample"`` (every sample once, the
    Trainer's) or ``"batch"`` (every batch once, whatever its size: transformers'
    ``Seq2SeqTrainer`` gathers each batch's loss repeated ``eval_batch_size`` times without
    dropping the short last batch's missing rows).
    """
    if loss_weighting not in ("sample", "batch"):
        raise ValueError(f"loss_weighting={loss_weighting!r}: expected 'sample' or 'batch'")
    unknown = set(include_for_metrics) - {"inputs", "loss"}
    if unknown:
        raise ValueError(
            f"include_for_metrics={list(include_for_metrics)!r}: unknown entries "
            f"{sorted(unknown)}; allowed: 'inputs', 'loss'"
        )
    want_inputs = "inputs" in include_for_metrics
    want_losses = "loss" in include_for_metrics
    if batch_eval_metrics and compute_metrics is None:
        raise ValueError(
            "batch_eval_metrics=True needs a compute_metrics(eval_pred, compute_result)"
        )

    acc = {
        name: PredictionAccumulator(do_concat=eval_do_concat_batches)
        for name in ("losses", "preds", "labels", "inputs")
    }
    # Per-sample weights of the mean loss when batches count once each (1/rows per row).
    loss_weights = PredictionAccumulator(do_concat=True) if loss_weighting == "batch" else None
    if accumulators is not None:
        accumulators.update(acc)
    keep = not batch_eval_metrics or keep_predictions
    metrics: Mapping[str, Any] | None = None
    num_samples = 0
    model.eval()
    begin_batch = getattr(gather, "begin_batch", None)  # an UnevenGather
    for index, (raw, is_last) in enumerate(_with_last(batches)):
        inputs = prepare(raw) if prepare is not None else raw
        batch_size = _batch_size(inputs, main_input_name)
        if begin_batch is not None:
            begin_batch(index, batch_size)
        loss, logits, labels = step(model, inputs)
        batch_inputs = inputs.get(main_input_name) if want_inputs else None
        sample_losses = None
        if loss is not None:
            # One loss per sample so the mean over the set weights batches by size.
            sample_losses = gather(loss.detach().reshape(1).repeat(batch_size))
            acc["losses"].add(sample_losses)
            if loss_weights is not None:
                share = torch.full((batch_size,), 1.0 / batch_size, dtype=torch.float32)
                loss_weights.add(gather(share.to(loss.device)))
        if batch_inputs is not None:
            batch_inputs = gather(batch_inputs)
            if keep:
                acc["inputs"].add(batch_inputs)
        if logits is not None and preprocess_logits_for_metrics is not None:
            logits = preprocess_logits_for_metrics(logits, labels)
        if logits is not None:
            logits = gather(logits)
            if keep:
                acc["preds"].add(logits)
        if labels is not None:
            labels = gather(labels)
            if keep:
                acc["labels"].add(labels)
        # Samples of every rank (gathered), else of this batch.
        gathered = next((x for x in (sample_losses, labels, logits) if x is not None), None)
        num_samples += _rows(gathered) if gathered is not None else batch_size
        if on_prediction_step is not None:
            on_prediction_step()

        if batch_eval_metrics and compute_metrics is not None and logits is not None:
            metrics = compute_metrics(
                EvalPrediction(
                    logits,
                    labels,
                    inputs=batch_inputs,
                    losses=sample_losses if want_losses else None,
                ),
                compute_result=is_last,
            )
        if eval_accumulation_steps is not None and (index + 1) % eval_accumulation_steps == 0:
            for a in (*acc.values(), *([loss_weights] if loss_weights is not None else [])):
                a.to_host()

    losses = acc["losses"].result()
    preds = acc["preds"].result()
    labels_all = acc["labels"].result()
    inputs_all = acc["inputs"].result()
    if not batch_eval_metrics:
        metrics = {}
        if compute_metrics is not None and preds is not None and labels_all is not None:
            metrics = compute_metrics(
                EvalPrediction(
                    preds,
                    labels_all,
                    inputs=inputs_all if want_inputs else None,
                    losses=losses if want_losses else None,
                )
            )
    result = dict(metrics or {})
    if losses is not None:
        weights = loss_weights.result() if loss_weights is not None else None
        mean = _mean_loss(losses, nan_inf_filter, weights)
        result["loss"] = mean if mean is not None else math.nan
    output = EvalLoopOutput(
        predictions=preds,
        label_ids=labels_all,
        metrics=prefix_metrics(result, metric_key_prefix),
        num_samples=num_samples,
    )
    return output


def evaluate_datasets(
    eval_dataset: Any,
    evaluate_one: Callable[[Any, str], dict[str, Any]],
    metric_key_prefix: str = "eval",
) -> dict[str, Any]:
    """Evaluate one dataset, or each of a dict of datasets with ``<prefix>_<name>`` metrics."""
    if isinstance(eval_dataset, Mapping):
        metrics: dict[str, Any] = {}
        for name, dataset in eval_dataset.items():
            metrics.update(evaluate_one(dataset, f"{metric_key_prefix}_{name}"))
        return metrics
    return evaluate_one(eval_dataset, metric_key_prefix)


def should_evaluate_at_step(
    eval_strategy: str, global_step: int, eval_steps: int, eval_delay: float = 0
) -> bool:
    """Evaluate after this optimizer step? (``eval_steps`` already resolved to steps.)"""
    return (
        eval_strategy == "steps"
        and eval_steps > 0
        and global_step % eval_steps == 0
        and global_step >= eval_delay
    )


def should_evaluate_at_epoch_end(eval_strategy: str, epoch: float, eval_delay: float = 0) -> bool:
    return eval_strategy == "epoch" and epoch >= eval_delay
