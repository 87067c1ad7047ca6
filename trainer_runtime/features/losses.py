"""Loss computation of the Trainer: the default path, custom ``compute_loss_func``, label
smoothing, and the token counting (``num_items_in_batch``) that makes gradient accumulation exact.

The rule the reference documents state:

* ``num_items_in_batch`` is the number of prediction targets in the whole accumulated batch (all
  micro-batches of one optimizer step, summed over ranks when ``average_tokens_across_devices``).
  For causal LMs the labels are shifted, so position 0 of each sequence has no target and only
  ``labels[..., 1:] != -100`` is counted.
* A custom ``compute_loss_func(outputs, labels, num_items_in_batch)`` owns its normalisation: the
  Trainer neither divides it by ``gradient_accumulation_steps`` nor averages it.
* ``loss_is_scaled_for_ga``: ``True`` -> use the loss as is; ``False`` -> divide by the number of
  accumulation steps; ``None`` -> the loss counts as scaled when it was normalised by
  ``num_items_in_batch``, i.e. when the model accepts loss kwargs or a ``compute_loss_func`` is
  used.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from trainer_runtime.data.columns import _is_peft_model, _peft_base
from trainer_runtime.distributed import collectives
from trainer_runtime.errors import ConfigurationError

__all__ = [
    "IGNORE_INDEX",
    "LabelSmoother",
    "compute_loss",
    "count_items_in_batch",
    "is_causal_lm",
    "label_smoothing_shifts",
    "loss_is_scaled",
    "model_accepts_loss_kwargs",
    "scale_loss_for_gradient_accumulation",
    "shifted_causal_lm_loss",
]

IGNORE_INDEX = -100

LossFunc = Callable[..., torch.Tensor]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP / torch.compile wrappers keep the user's module in .module / ._orig_mod; a PEFT model
    # is judged by its base model, as transformers does (PeftModelForCausalLM around GPT-2 is
    # not a causal LM by transformers' counting rule, GPT-2's own class name decides).
    while True:
        if _is_peft_model(model):
            model = _peft_base(model)
            continue
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def is_causal_lm(model: torch.nn.Module) -> bool:
    """Whether labels are shifted inside the model (targets start at position 1).

    An explicit ``is_causal_lm`` attribute wins; otherwise the Hugging Face naming convention
    (``...ForCausalLM``) or ``config.is_decoder`` / ``config.architectures`` decide.
    """
    model = _unwrap(model)
    explicit = getattr(model, "is_causal_lm", None)
    if isinstance(explicit, bool):
        return explicit
    if "CausalLM" in type(model).__name__:
        return True
    config = getattr(model, "config", None)
    if config is not None:
        if getattr(config, "is_decoder", False) is True:
            return True
        archs = getattr(config, "architectures", None) or ()
        return any("CausalLM" in str(a) for a in archs)
    return False


def label_smoothing_shifts(model: torch.nn.Module) -> bool:
    """Whether the label smoother shifts the labels: a causal LM by :func:`is_causal_lm`, or a
    model whose class transformers maps as a causal LM (``GPT2LMHeadModel`` among them), the
    rule transformers' Trainer applies to label smoothing (it differs from its counting rule)."""
    return is_causal_lm(model) or type(_unwrap(model)).__name__ in _transformers_causal_lm_names()


@functools.cache
def _transformers_causal_lm_names() -> frozenset[str]:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # transformers is optional; without it only is_causal_lm decides
        return frozenset()
    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def model_accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """True when ``model.forward`` can take ``num_items_in_batch`` (named or via ``**kwargs``).

    A model may state it with an ``accepts_loss_kwargs`` attribute (as Hugging Face models do).
    """
    model = _unwrap(model)
    explicit = getattr(model, "accepts_loss_kwargs", None)
    if isinstance(explicit, bool):
        return explicit
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "num_items_in_batch" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


def count_items_in_batch(
    batches: Iterable[Mapping[str, Any]],
    *,
    shift_labels: bool,
    label_name: str = "labels",
    ignore_index: int = IGNORE_INDEX,
    across_ranks: bool = False,
) -> int | None:
    """Number of prediction targets in the micro-batches of one optimizer step.

    ``shift_labels`` counts ``labels[..., 1:]`` (causal LMs). A batch carrying ``shift_labels``
    (already shifted targets) is counted as is. Returns ``None`` when no batch has labels, which
    makes the losses fall back to per-batch means. ``across_ranks`` sums the count over all ranks
    of a process group (``average_tokens_across_devices``).
    """
    total = 0
    seen = False
    for batch in batches:
        if "shift_labels" in batch and batch["shift_labels"] is not None:
            labels = batch["shift_labels"]
        elif label_name in batch and batch[label_name] is not None:
            labels = batch[label_name]
            if shift_labels:
                labels = labels[..., 1:]
        else:
            continue
        seen = True
        total += int((labels != ignore_index).sum().item())
    if not seen:
        return None
    if across_ranks:
        total = collectives.all_reduce_sum(total)
    return total


def _logits_of(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, (tuple, list)):
        # (loss, logits, ...) when the model computed a loss, else (logits, ...)
        return outputs[1] if len(outputs) > 1 and outputs[0].dim() == 0 else outputs[0]
    if isinstance(outputs, torch.Tensor):
        return outputs
    raise TypeError(f"cannot find logits in model outputs of type {type(outputs).__name__}")


def _smoothed_token_losses(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-target losses (summed) and the number of targets, with label smoothing ``epsilon``.

    Target distribution: ``1 - eps + eps/C`` on the true class, ``eps/C`` elsewhere, so the loss
    per target is ``(1 - eps) * nll + eps * mean_c(-log p_c)``.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    mask = labels != ignore_index
    safe = labels.clamp(min=0).unsqueeze(-1)
    nll = -log_probs.gather(dim=-1, index=safe).squeeze(-1)
    per_target = nll
    if epsilon:
        uniform = -log_probs.mean(dim=-1)
        per_target = (1.0 - epsilon) * nll + epsilon * uniform
    per_target = per_target.masked_fill(~mask, 0.0)
    return per_target.sum(), mask.sum()


class LabelSmoother:
    """Cross-entropy with label smoothing over model outputs (``label_smoothing_factor``).

    Normalised by ``num_items_in_batch`` when given (the accumulated batch), else by the number of
    targets of this batch.
    """

    def __init__(self, epsilon: float = 0.1, ignore_index: int = IGNORE_INDEX) -> None:
        if not 0.0 <= epsilon < 1.0:
            raise ConfigurationError(
                f"label_smoothing_factor={epsilon!r} is outside [0, 1): use e.g. 0.1, or 0 to "
                "disable"
            )
        self.epsilon = float(epsilon)
        self.ignore_index = ignore_index

    def __call__(
        self,
        outputs: Any,
        labels: torch.Tensor,
        shift_labels: bool = False,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        logits = _logits_of(outputs)
        if shift_labels:
            logits = logits[..., :-1, :]
            labels = labels[..., 1:]
        total, count = _smoothed_token_losses(logits, labels, self.epsilon, self.ignore_index)
        denom = num_items_in_batch if num_items_in_batch is not None else count
        return total / torch.as_tensor(denom, dtype=total.dtype, device=total.device).clamp(min=1)


def shifted_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The causal-LM loss a model computes: position t predicts token t+1.

    Summed over targets and divided by ``num_items_in_batch`` (exact over gradient accumulation)
    when given, else the mean over this batch's targets.
    """
    shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[..., 1:].reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    return total / num_items_in_batch


def loss_is_scaled(
    loss_is_scaled_for_ga: bool | None,
    *,
    model_accepts_loss_kwargs: bool,
    has_compute_loss_func: bool,
    num_items_in_batch: int | torch.Tensor | None,
    has_label_smoother: bool = False,
) -> bool:
    """Whether the loss from ``compute_loss`` is already normalised over the accumulated batch.

    An explicit ``loss_is_scaled_for_ga`` wins. Otherwise a custom ``compute_loss_func`` owns its
    normalisation (scaled), and the default and label-smoothing paths are scaled exactly when they
    divided by ``num_items_in_batch``.
    """
    if loss_is_scaled_for_ga is not None:
        return bool(loss_is_scaled_for_ga)
    if has_compute_loss_func:
        return True
    return num_items_in_batch is not None and (model_accepts_loss_kwargs or has_label_smoother)


def scale_loss_for_gradient_accumulation(
    loss: torch.Tensor, gradient_accumulation_steps: int, *, already_scaled: bool
) -> torch.Tensor:
    """What ``training_step`` back-propagates: the loss as is, or divided by the GA steps."""
    if already_scaled or gradient_accumulation_steps == 1:
        return loss
    return loss / gradient_accumulation_steps


def _pop_labels(inputs: dict[str, Any], label_names: Sequence[str]) -> Any:
    names = [n for n in label_names if n in inputs]
    if not names:
        return None
    if len(names) == 1:
        return inputs.pop(names[0])
    return tuple(inputs.pop(n) for n in names)


def compute_loss(
    model: torch.nn.Module,
    inputs: Mapping[str, Any],
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    compute_loss_func: LossFunc | None = None,
    label_smoother: LabelSmoother | None = None,
    label_names: Sequence[str] = ("labels",),
    accepts_loss_kwargs: bool | None = None,
    world_size: int = 1,
    average_tokens_across_devices: bool = False,
) -> tuple[torch.Tensor, Any]:
    """Run the forward pass and compute the loss as ``Trainer.compute_loss`` does.

    * With ``compute_loss_func`` or ``label_smoother``, the labels are removed from the inputs
      before the forward pass and the loss is computed from the raw outputs.
    * Otherwise the model computes its loss from ``labels`` (first output or ``outputs["loss"]``);
      ``num_items_in_batch`` is passed to it when it accepts loss kwargs.
    * When the loss was normalised by a token count summed over ranks, it is multiplied by the
      world size, because DDP averages gradients over ranks.

    Returns ``(loss, outputs)``.
    """
    inputs = dict(inputs)
    if accepts_loss_kwargs is None:
        accepts_loss_kwargs = model_accepts_loss_kwargs(model)
    custom = compute_loss_func is not None or label_smoother is not None
    labels = _pop_labels(inputs, label_names) if custom else None
    if accepts_loss_kwargs and num_items_in_batch is not None:
        inputs["num_items_in_batch"] = num_items_in_batch
    outputs = model(**inputs)

    if labels is not None and compute_loss_func is not None:
        loss = compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    elif labels is not None and label_smoother is not None:
        loss = label_smoother(
            outputs,
            labels,
            shift_labels=label_smoothing_shifts(model),
            num_items_in_batch=num_items_in_batch,
        )
    else:
        if isinstance(outputs, Mapping):
            if "loss" not in outputs:
                raise ValueError(
                    "the model did not return a loss: its outputs have keys "
                    f"{sorted(outputs)}; pass the labels in the inputs (label_names="
                    f"{list(label_names)}) or give the Trainer a compute_loss_func"
                )
            loss = outputs["loss"]
        elif hasattr(outputs, "loss"):
            loss = outputs.loss
        else:
            loss = outputs[0]
    normalised = loss_is_scaled(
        None,
        model_accepts_loss_kwargs=accepts_loss_kwargs,
        has_compute_loss_func=compute_loss_func is not None,
        num_items_in_batch=num_items_in_batch,
        has_label_smoother=label_smoother is not None,
    )
    if average_tokens_across_devices and world_size > 1 and normalised and num_items_in_batch:
        # The count was summed over ranks and DDP averages gradients over ranks: undo the mean.
        loss = loss * world_size
    return loss, outputs
