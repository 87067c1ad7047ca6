"""Padding collation for variable-length examples (what length-based sampling produces).

:class:`PaddingCollator` pads every sequence field of a list of mapping examples to the longest one
in the batch (optionally rounded up to a multiple), builds an ``attention_mask`` when the examples
have none, and stacks scalar fields. It needs no tokenizer: pad values are given per field.

:class:`DataCollatorWithPadding` is transformers' collator of the same name, written for any object
with a ``pad`` method (a tokenizer or a feature extractor): the Trainer's default collator when
``processing_class`` is one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from trainer_runtime.errors import ConfigurationError

__all__ = ["LABEL_PAD_TOKEN_ID", "DataCollatorWithPadding", "PaddingCollator"]

# Positions with this label are ignored by torch's cross-entropy (its default ignore_index).
LABEL_PAD_TOKEN_ID = -100
_LABEL_KEYS = ("labels", "label_ids", "label")
_ZERO_PAD_KEYS = ("attention_mask", "token_type_ids", "special_tokens_mask", "position_ids")


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return torch.tensor(value)


def _is_sequence(value: Any) -> bool:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.ndim >= 1
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


@dataclass
class PaddingCollator:
    """Collate mapping examples, padding sequence fields along their first dimension.

    Args:
        pad_token_id: pad value of input fields (``input_ids`` and any field not listed below).
        label_pad_token_id: pad value of ``labels``/``label_ids`` (ignored by the loss).
        pad_values: per-field pad values overriding the defaults (``attention_mask``,
            ``token_type_ids``, ``special_tokens_mask``, ``position_ids`` pad with 0).
        padding_side: ``"right"`` (default) or ``"left"`` (decoder-only generation).
        pad_to_multiple_of: round the padded length up to a multiple (tensor-core friendly).
        model_input_name: the field an ``attention_mask`` is derived from when absent.
        return_attention_mask: build ``attention_mask`` from the lengths of ``model_input_name``.

    ``label`` is renamed ``labels`` as in Hugging Face. Non-numeric fields (strings) stay lists.
    """

    pad_token_id: int = 0
    label_pad_token_id: int = LABEL_PAD_TOKEN_ID
    pad_values: dict[str, int | float] = field(default_factory=dict)
    padding_side: Literal["right", "left"] = "right"
    pad_to_multiple_of: int | None = None
    model_input_name: str = "input_ids"
    return_attention_mask: bool = True

    def __post_init__(self) -> None:
        if self.padding_side not in ("right", "left"):
            raise ConfigurationError(
                f"padding_side={self.padding_side!r} is not valid: use 'right' or 'left'"
            )
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise ConfigurationError(
                f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be >= 1 or None"
            )

    def pad_value(self, key: str) -> int | float:
        if key in self.pad_values:
            return self.pad_values[key]
        if key in _LABEL_KEYS:
            return self.label_pad_token_id
        if key in _ZERO_PAD_KEYS:
            return 0
        return self.pad_token_id

    def _target_length(self, longest: int) -> int:
        if self.pad_to_multiple_of:
            return math.ceil(longest / self.pad_to_multiple_of) * self.pad_to_multiple_of
        return longest

    def _pad(self, key: str, values: list[Any]) -> torch.Tensor:
        tensors = [_as_tensor(v) for v in values]
        trailing = {tuple(t.shape[1:]) for t in tensors}
        if len(trailing) != 1:
            raise ConfigurationError(
                f"cannot pad field {key!r}: examples differ beyond the first dimension "
                f"({sorted(trailing)}); only the sequence (first) dimension may vary"
            )
        target = self._target_length(max(t.shape[0] for t in tensors))
        # An empty python list becomes float32: let non-empty examples decide the dtype.
        dtypes = [t.dtype for t in tensors if t.numel() > 0] or [torch.long]
        dtype = dtypes[0]
        for other in dtypes[1:]:
            dtype = torch.promote_types(dtype, other)
        out = torch.full(
            (len(tensors), target, *tensors[0].shape[1:]), self.pad_value(key), dtype=dtype
        )
        for row, t in enumerate(tensors):
            n = t.shape[0]
            if self.padding_side == "right":
                out[row, :n] = t.to(dtype)
            else:
                out[row, target - n :] = t.to(dtype)
        return out

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        if not features:
            raise ConfigurationError("PaddingCollator got an empty batch")
        if not all(isinstance(f, Mapping) for f in features):
            kinds = sorted({type(f).__name__ for f in features})
            raise ConfigurationError(
                f"PaddingCollator expects mapping examples (dicts), got {kinds}; "
                "return dicts from the dataset"
            )
        keys = list(features[0].keys())
        for i, f in enumerate(features[1:], start=1):
            if set(f.keys()) != set(keys):
                raise ConfigurationError(
                    f"example {i} has keys {sorted(f.keys())} but example 0 has {sorted(keys)}; "
                    "every example of a batch needs the same fields"
                )
        batch: dict[str, Any] = {}
        for key in keys:
            values = [f[key] for f in features]
            out_key = "labels" if key == "label" and "labels" not in keys else key
            if all(v is None for v in values):
                continue
            if isinstance(values[0], str | bytes):
                batch[out_key] = list(values)
            elif _is_sequence(values[0]):
                batch[out_key] = self._pad(key, values)
            else:
                batch[out_key] = _as_tensor(values)
        if (
            self.return_attention_mask
            and "attention_mask" not in batch
            and self.model_input_name in keys
            and _is_sequence(features[0][self.model_input_name])
        ):
            batch["attention_mask"] = self._mask([f[self.model_input_name] for f in features])
        return batch

    def _mask(self, values: list[Any]) -> torch.Tensor:
        lengths = [len(_as_tensor(v)) for v in values]
        target = self._target_length(max(lengths))
        mask = torch.zeros((len(values), target), dtype=torch.long)
        for row, n in enumerate(lengths):
            if self.padding_side == "right":
                mask[row, :n] = 1
            else:
                mask[row, target - n :] = 1
        return mask


@dataclass
class DataCollatorWithPadding:
    """Pad a list of examples with ``tokenizer.pad`` (its pad token, padding side and
    ``model_input_names``), as transformers' ``DataCollatorWithPadding``.

    ``padding``/``max_length``/``pad_to_multiple_of``/``return_tensors`` go to ``pad`` unchanged;
    ``label`` and ``label_ids`` become ``labels``. Labels are stacked, not padded: for sequence
    labels use a collator that pads them with -100 (e.g. :class:`PaddingCollator`).
    """

    tokenizer: Any
    padding: bool | str = True
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self) -> None:
        if not callable(getattr(self.tokenizer, "pad", None)):
            raise ConfigurationError(
                f"DataCollatorWithPadding needs a tokenizer or feature extractor with a pad() "
                f"method, got {type(self.tokenizer).__name__}: pass data_collator= instead"
            )

    def _pad(self, features: list[Any]) -> Any:
        kwargs = {
            "padding": self.padding,
            "max_length": self.max_length,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "return_tensors": self.return_tensors,
        }
        warnings_state = getattr(self.tokenizer, "deprecation_warnings", None)
        if not isinstance(warnings_state, dict):
            return self.tokenizer.pad(features, **kwargs)
        # A fast tokenizer warns that pad() is slower than __call__; the examples are already
        # token ids, so the warning would only be noise (transformers silences it the same way).
        key = "Asking-to-pad-a-fast-tokenizer"
        before = warnings_state.get(key, False)
        warnings_state[key] = True
        try:
            return self.tokenizer.pad(features, **kwargs)
        finally:
            warnings_state[key] = before

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        if not features:
            raise ConfigurationError("DataCollatorWithPadding got an empty batch")
        batch = dict(self._pad(list(features)))
        for key in ("label", "label_ids"):
            if key in batch:
                batch["labels"] = batch.pop(key)
        return batch
