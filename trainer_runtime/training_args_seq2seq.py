"""Seq2SeqTrainingArguments: TrainingArguments plus transformers 5.x's generation fields.

A standard ``@dataclass`` subclass of :class:`~trainer_runtime.training_args.TrainingArguments`
(as in transformers), so ``HfArgumentParser``, ``dataclasses.fields`` / ``replace`` / ``asdict``
see the five extra fields after the inherited ones. The inherited fields are validated by
``TrainingArgumentsSchema`` as usual; the extra ones by :class:`Seq2SeqArgumentsSchema` (at
construction and on every later assignment), with the same :class:`ConfigurationError` messages.

Torch-free, and transformers-free at import: a ``GenerationConfig`` is recognised by duck typing
(``to_dict`` and ``validate``), so parsing arguments never imports transformers.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from trainer_runtime.errors import ConfigurationError
from trainer_runtime.training_args import TrainingArguments, UnknownArgumentError

__all__ = ["Seq2SeqArgumentsSchema", "Seq2SeqTrainingArguments", "is_generation_config"]


def is_generation_config(value: Any) -> bool:
    """Whether ``value`` is a ``transformers.GenerationConfig`` (or quacks like one)."""
    return callable(getattr(value, "to_dict", None)) and callable(getattr(value, "validate", None))


class Seq2SeqArgumentsSchema(BaseModel):
    """Checks of the fields :class:`Seq2SeqTrainingArguments` adds (names and defaults of
    transformers 5.x's ``Seq2SeqTrainingArguments``)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    sortish_sampler: bool = Field(
        False,
        description="Accepted for compatibility and without effect, as in transformers 5.x (no "
        "sampler reads it); for length-grouped batches use group_by_length=True.",
    )
    predict_with_generate: bool = Field(
        False,
        description="evaluate()/predict() run model.generate and hand the generated token ids "
        "to compute_metrics (ROUGE, BLEU, exact match, ...) instead of the logits.",
    )
    generation_max_length: int | None = Field(
        None,
        ge=1,
        description="max_length of generate() in evaluate()/predict() with predict_with_generate "
        "(unless max_length or max_new_tokens is passed); default: the model's generation config.",
    )
    generation_num_beams: int | None = Field(
        None,
        ge=1,
        description="num_beams of generate() in evaluate()/predict() with predict_with_generate "
        "(unless num_beams is passed); default: the model's generation config.",
    )
    generation_config: Any = Field(
        None,
        description="GenerationConfig for evaluation/prediction: a GenerationConfig, a directory "
        "holding generation_config.json, a path to such a JSON file, or a model id; it replaces "
        "model.generation_config when the Seq2SeqTrainer is created.",
    )

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, value: Any) -> Any:
        if value is None or isinstance(value, (str, os.PathLike)) or is_generation_config(value):
            return value
        raise ValueError(
            "expected a transformers.GenerationConfig, a path (directory or JSON file) or a "
            f"model id, got {type(value).__name__}"
        )


_NEW_FIELDS: tuple[str, ...] = tuple(Seq2SeqArgumentsSchema.model_fields)


def _format_errors(exc: ValidationError, values: dict[str, Any]) -> str:
    lines = [f"invalid Seq2SeqTrainingArguments ({exc.error_count()} error(s)):"]
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        info = Seq2SeqArgumentsSchema.model_fields.get(name)
        desc = f" ({info.description})" if info is not None and info.description else ""
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  - {name}={values.get(name)!r}: {msg}{desc}")
    return "\n".join(lines)


def _validate_new_fields(values: dict[str, Any]) -> Seq2SeqArgumentsSchema:
    try:
        return Seq2SeqArgumentsSchema(**values)
    except ValidationError as exc:
        raise ConfigurationError(_format_errors(exc, values)) from None


def _help(name: str) -> dict[str, str]:
    return {"help": Seq2SeqArgumentsSchema.model_fields[name].description or ""}


@dataclasses.dataclass(repr=False)
class Seq2SeqTrainingArguments(TrainingArguments):  # type: ignore[misc, valid-type]
    """Arguments of :class:`trainer_runtime.Seq2SeqTrainer`: every field of
    :class:`~trainer_runtime.TrainingArguments` plus transformers 5.x's ``sortish_sampler``,
    ``predict_with_generate``, ``generation_max_length``, ``generation_num_beams`` and
    ``generation_config`` (same names, types and defaults). Invalid values raise
    ConfigurationError naming the field, the value and the fix; assignments are validated too."""

    sortish_sampler: bool = dataclasses.field(default=False, metadata=_help("sortish_sampler"))
    predict_with_generate: bool = dataclasses.field(
        default=False, metadata=_help("predict_with_generate")
    )
    generation_max_length: int | None = dataclasses.field(
        default=None, metadata=_help("generation_max_length")
    )
    generation_num_beams: int | None = dataclasses.field(
        default=None, metadata=_help("generation_num_beams")
    )
    # HfArgumentParser reads the first non-str, non-None member: a path on the command line.
    generation_config: str | Path | Any | None = dataclasses.field(
        default=None, metadata=_help("generation_config")
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        model = _validate_new_fields({name: self.__dict__[name] for name in _NEW_FIELDS})
        for name in _NEW_FIELDS:
            self.__dict__[name] = getattr(model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _NEW_FIELDS and self.__dict__.get("_preemptible_validated"):
            current = {n: self.__dict__[n] for n in _NEW_FIELDS}
            value = getattr(_validate_new_fields({**current, name: value}), name)
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def to_dict(self) -> dict[str, Any]:
        """As TrainingArguments.to_dict, with a GenerationConfig written as its dict."""
        out = super().to_dict()
        value = self.generation_config
        if is_generation_config(value):
            out["generation_config"] = value.to_dict()
        elif isinstance(value, os.PathLike):
            out["generation_config"] = os.fspath(value)
        return out


def _check_known(cls: type) -> None:
    """Give the generated ``__init__`` TrainingArguments' error for an unknown argument (a
    ConfigurationError that is also a TypeError, with a did-you-mean hint)."""
    generated = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        known = cls.__dataclass_fields__  # type: ignore[attr-defined]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            lines = [f"invalid {cls.__name__} ({len(unknown)} error(s)):"]
            for name in unknown:
                close = difflib.get_close_matches(name, list(known), n=1)
                hint = f"did you mean {close[0]!r}?" if close else "remove it"
                lines.append(f"  - {name}: unknown argument; {hint}")
            raise UnknownArgumentError("\n".join(lines))
        generated(self, *args, **kwargs)

    __init__.__signature__ = inspect.signature(generated)  # type: ignore[attr-defined]
    __init__.__doc__ = generated.__doc__
    cls.__init__ = __init__  # type: ignore[method-assign]


_check_known(Seq2SeqTrainingArguments)
