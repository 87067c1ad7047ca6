"""remove_unused_columns: keep only what the model's forward accepts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from trainer_runtime.data.collators import PaddingCollator
from trainer_runtime.data.columns import (
    RemoveColumnsCollator,
    default_label_names,
    remove_unused_columns,
    signature_columns,
)
from trainer_runtime.errors import ConfigurationError


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        return self.embed(input_ids)


class KwargsModel(nn.Module):
    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return input_ids


@pytest.mark.parametrize(
    ("model", "label_names", "expected"),
    [
        (Model(), None, ["input_ids", "labels", "label", "label_ids"]),
        (
            Model(),
            ["start_positions"],
            ["input_ids", "labels", "label", "label_ids", "start_positions"],
        ),
        # **kwargs adds nothing (transformers 5.x forwards all take it): only named inputs.
        (KwargsModel(), None, ["input_ids", "label", "label_ids", "labels"]),
        (torch.nn.DataParallel(Model()), None, ["input_ids", "labels", "label", "label_ids"]),
    ],
)
def test_signature_columns(model: Any, label_names: list[str] | None, expected: Any) -> None:
    assert signature_columns(model, label_names) == expected


def test_collator_wrapper_drops_unused_fields() -> None:
    collate = RemoveColumnsCollator(PaddingCollator(), Model())
    batch = collate(
        [
            {"input_ids": [1, 2], "labels": [1, 2], "text": "hi", "length": 2},
            {"input_ids": [3], "labels": [3], "text": "yo", "length": 1},
        ]
    )
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    Model()(batch["input_ids"], labels=batch["labels"])  # the batch fits forward()


def test_collator_wrapper_drops_fields_a_kwargs_forward_does_not_name() -> None:
    collate = RemoveColumnsCollator(PaddingCollator(), KwargsModel())
    batch = collate([{"input_ids": [1], "text": "x", "label": 1}])
    assert set(batch) == {"input_ids", "labels", "attention_mask"}


class PeftModelStandIn(nn.Module):
    """What peft's wrapper looks like to column removal: forward(*args, **kwargs), the real
    model behind get_base_model()."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Model()

    def get_base_model(self) -> nn.Module:
        return self.inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)


PeftModelStandIn.__module__ = "peft.peft_model"


def test_peft_models_are_inspected_through_their_base_model() -> None:
    assert signature_columns(PeftModelStandIn()) == ["input_ids", "labels", "label", "label_ids"]


def test_collator_wrapper_refuses_to_drop_everything() -> None:
    collate = RemoveColumnsCollator(PaddingCollator(), Model())
    with pytest.raises(ConfigurationError, match="remove_unused_columns=False"):
        collate([{"tokens": [1, 2]}])


def test_other_datasets_are_returned_unchanged() -> None:
    data = [{"input_ids": [1], "text": "x"}]
    assert remove_unused_columns(data, Model()) is data


def test_hf_dataset_columns_are_removed() -> None:
    import datasets  # a dev dependency: a missing install fails here instead of skipping

    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2], [3]], "text": ["a", "b"], "length": [2, 1], "label": [0, 1]}
    )
    out = remove_unused_columns(ds, Model())
    assert out.column_names == ["input_ids", "label"]
    kept = remove_unused_columns(ds, Model(), keep=["length"])
    assert kept.column_names == ["input_ids", "length", "label"]
    assert remove_unused_columns(ds, KwargsModel()).column_names == ["input_ids", "label"]
    with pytest.raises(ConfigurationError, match="would remove every field"):
        remove_unused_columns(ds.select_columns(["text"]), Model())


class _QuestionAnsweringModel(torch.nn.Module):
    def forward(self, input_ids=None, start_positions=None, end_positions=None):  # type: ignore[no-untyped-def]
        return input_ids


class _Labelled(torch.nn.Module):
    def forward(self, input_ids=None, labels=None, label_weights=None):  # type: ignore[no-untyped-def]
        return input_ids


class _Kwargs(torch.nn.Module):
    def forward(self, **kwargs):  # type: ignore[no-untyped-def]
        return kwargs


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (_QuestionAnsweringModel(), ["start_positions", "end_positions"]),
        (_Labelled(), ["labels", "label_weights"]),
        (_Kwargs(), ["labels"]),  # nothing named: the loop's convention
    ],
)
def test_default_label_names_follow_forward(model: torch.nn.Module, expected: list[str]) -> None:
    assert default_label_names(model) == expected
