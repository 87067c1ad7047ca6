"""Default collation: a list of examples (mappings) -> a dict of batched tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["default_collator_for", "default_data_collator"]


def _stack(key: str, values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(values)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(values))
    if isinstance(first, bool):
        return torch.tensor(values, dtype=torch.bool)
    if isinstance(first, int):
        return torch.tensor(values, dtype=torch.long)
    if isinstance(first, float):
        return torch.tensor(values, dtype=torch.float32)
    if isinstance(first, Sequence) and not isinstance(first, str):
        try:
            return torch.tensor(values)
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"cannot collate field {key!r}: lists of different lengths or types ({exc}); "
                "pad them in the dataset or pass a data_collator that pads"
            ) from exc
    # Strings and other objects stay as a plain list.
    return list(values)


def default_data_collator(features: list[Any]) -> dict[str, Any]:
    """Stack a list of examples into a batch.

    Examples are mappings (dicts of tensors, numpy arrays, numbers or equal-length lists), or
    tuples/lists of such values (keys become positions). ``label``/``label_ids`` become ``labels``
    as in Hugging Face.
    """
    if not features:
        raise ValueError("default_data_collator got an empty batch")
    first = features[0]
    if not isinstance(first, Mapping):
        if isinstance(first, Sequence) and not isinstance(first, str):
            return {str(i): _stack(str(i), [f[i] for f in features]) for i in range(len(first))}
        raise TypeError(
            f"default_data_collator expects mappings (dict examples), got {type(first).__name__}; "
            "return dicts from the dataset or pass data_collator="
        )
    batch: dict[str, Any] = {}
    for key in first:
        values = [f[key] for f in features]
        if values[0] is None:
            continue
        out_key = "labels" if key in ("label", "label_ids") and "labels" not in first else key
        batch[out_key] = _stack(key, values)
    return batch


def _is_padding_processor(processing_class: Any) -> bool:
    """Is ``processing_class`` a tokenizer or a sequence feature extractor (transformers' test)?

    Without transformers loaded, no transformers object can exist, so any object with a ``pad``
    method counts (a tokenizer-like object of another library)."""
    import sys

    if "transformers" in sys.modules:
        import transformers

        kinds = tuple(
            cls
            for cls in (
                getattr(transformers, "PreTrainedTokenizerBase", None),
                getattr(transformers, "SequenceFeatureExtractor", None),
            )
            if cls is not None
        )
        if isinstance(processing_class, kinds):
            return True
        # Other transformers classes (processors, image processors) get default_data_collator.
        if type(processing_class).__module__.split(".")[0] == "transformers":
            return False
    return callable(getattr(processing_class, "pad", None))


def default_collator_for(processing_class: Any = None) -> Callable[[list[Any]], Any]:
    """The Trainer's collator when none is given: as transformers, a
    :class:`~trainer_runtime.data.collators.DataCollatorWithPadding` over ``processing_class`` when
    it is a tokenizer or feature extractor (it pads), else :func:`default_data_collator`."""
    if processing_class is not None and _is_padding_processor(processing_class):
        from trainer_runtime.data.collators import DataCollatorWithPadding

        return DataCollatorWithPadding(processing_class)
    return default_data_collator
