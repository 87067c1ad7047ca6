"""``remove_unused_columns``: drop dataset fields the model's ``forward`` does not accept.

A ``datasets.Dataset`` (when the ``datasets`` package is installed) loses those columns up front
(:func:`remove_unused_columns`); any other dataset of mapping examples gets the fields dropped per
batch by :class:`RemoveColumnsCollator`, which wraps the real collator.

As in transformers, the accepted fields are ``forward``'s named parameters plus the label columns:
a ``**kwargs`` parameter does not make every field acceptable (every transformers 5.x ``forward``
takes ``**kwargs``, and a raw ``text`` column must still go). A PEFT model is inspected through its
base model, whose ``forward`` names the real inputs.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from trainer_runtime.errors import ConfigurationError

__all__ = [
    "DEFAULT_LABEL_COLUMNS",
    "RemoveColumnsCollator",
    "is_hf_dataset",
    "remove_unused_columns",
    "signature_columns",
]

logger = logging.getLogger(__name__)

# Kept even when forward() does not name them: collators rename them to ``labels``.
DEFAULT_LABEL_COLUMNS = ("label", "label_ids")


def _is_peft_model(model: Any) -> bool:
    # Checked by module name: peft is optional and need not be imported to recognise its models.
    return any(cls.__module__.split(".")[0] == "peft" for cls in type(model).__mro__)


def _peft_base(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (``PeftMixedModel`` has no get_base_model)."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):
        return get_base_model()
    return model.base_model.model


def _forward_of(model: Any) -> Callable[..., Any]:
    # DDP / DataParallel keep the user's model under .module, torch.compile under ._orig_mod; a
    # PEFT model's forward takes (*args, **kwargs) and hands them to its base model's.
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    inner = model
    while True:
        if isinstance(inner, DataParallel | DistributedDataParallel):
            inner = inner.module
        elif getattr(inner, "_orig_mod", None) is not None:
            inner = inner._orig_mod
        elif _is_peft_model(inner):
            inner = _peft_base(inner)
        else:
            break
    forward = getattr(inner, "forward", None)
    if forward is None:
        if callable(inner):
            return inner
        raise ConfigurationError(
            f"remove_unused_columns needs a model with a forward method, got {type(model).__name__}"
        )
    return forward


def signature_columns(model: Any, label_names: Iterable[str] | None = None) -> list[str]:
    """Fields the model accepts: ``forward``'s named parameters plus the label columns
    (``label``, ``label_ids`` and ``label_names``; collators rename the first two ``labels``).

    ``*args`` / ``**kwargs`` add nothing: as in transformers, only named inputs are kept.
    """
    params = inspect.signature(_forward_of(model)).parameters.values()
    names = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    # Without label_names: the Trainer's default, ``labels``.
    extra = [*DEFAULT_LABEL_COLUMNS, *(("labels",) if label_names is None else label_names)]
    return list(dict.fromkeys([*names, *extra]))


def default_label_names(model: Any) -> list[str]:
    """The Trainer's ``label_names`` when the arguments give none, as transformers finds them:
    ``forward``'s parameters whose name contains ``label`` (plus ``start_positions`` /
    ``end_positions`` for a question-answering class). ``["labels"]`` when forward names none
    (a plain module taking ``**kwargs``), the convention the rest of the loop relies on."""
    inner = _forward_of(model)
    owner = getattr(inner, "__self__", None)
    qa = owner is not None and "QuestionAnswering" in type(owner).__name__
    names = [
        name
        for name in inspect.signature(inner).parameters
        if "label" in name or (qa and name in ("start_positions", "end_positions"))
    ]
    return names or ["labels"]


def is_hf_dataset(dataset: Any) -> bool:
    """True for a ``datasets.Dataset`` (without importing ``datasets`` when it is not loaded)."""
    import sys

    module = sys.modules.get("datasets")
    cls = getattr(module, "Dataset", None) if module is not None else None
    return cls is not None and isinstance(dataset, cls)


def _no_match_error(present: list[str], accepted: list[str]) -> ConfigurationError:
    return ConfigurationError(
        f"remove_unused_columns=True would remove every field: the dataset has {present} but "
        f"the model's forward accepts {accepted}; rename the fields to match forward() or set "
        "remove_unused_columns=False"
    )


def remove_unused_columns(
    dataset: Any,
    model: Any,
    *,
    label_names: Iterable[str] | None = None,
    keep: Iterable[str] = (),
) -> Any:
    """``dataset`` without the columns ``model.forward`` does not accept.

    Only a ``datasets.Dataset`` is changed (a new dataset is returned, as ``remove_columns`` does);
    any other dataset is returned as is: wrap its collator in :class:`RemoveColumnsCollator`.
    ``keep`` names columns to keep regardless (e.g. the length column a sampler still reads).
    """
    if not is_hf_dataset(dataset):
        return dataset
    accepted = signature_columns(model, label_names)
    wanted = set(accepted) | set(keep)
    present = list(dataset.column_names)
    unused = [c for c in present if c not in wanted]
    if not unused:
        return dataset
    if len(unused) == len(present):
        raise _no_match_error(present, accepted)
    logger.info(
        "removing dataset columns not accepted by %s.forward: %s",
        type(model).__name__,
        ", ".join(unused),
    )
    return dataset.remove_columns(unused)


class RemoveColumnsCollator:
    """Wrap ``collator`` so each mapping example keeps only the fields ``forward`` accepts.

    Picklable (no closures), so it works with ``spawn`` DataLoader workers when the wrapped
    collator is importable.
    """

    def __init__(
        self,
        collator: Callable[[list[Any]], Any],
        model: Any = None,
        *,
        label_names: Iterable[str] | None = None,
        columns: Iterable[str] | None = None,
    ) -> None:
        if columns is None:
            if model is None:
                raise ConfigurationError("RemoveColumnsCollator needs model= or columns=")
            self.columns = frozenset(signature_columns(model, label_names))
        else:
            self.columns = frozenset(columns)
        self.collator = collator
        self._reported: set[str] = set()

    def _filter(self, example: Any) -> Any:
        if not isinstance(example, Mapping):
            return example
        kept = {k: v for k, v in example.items() if k in self.columns}
        if not kept and example:
            raise _no_match_error(sorted(example), sorted(self.columns))
        dropped = set(example) - self.columns - self._reported
        if dropped:
            self._reported |= dropped
            logger.info("removing fields not accepted by forward(): %s", ", ".join(sorted(dropped)))
        return kept

    def __call__(self, features: list[Any]) -> Any:
        return self.collator([self._filter(f) for f in features])
