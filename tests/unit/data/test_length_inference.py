"""Length inference for the length-based samplers (pure functions: table tests)."""

from __future__ import annotations

from collections import UserDict
from typing import Any

import numpy as np
import pytest
import torch

from trainer_runtime.data.length_sampling import infer_lengths, item_length, padded_cost
from trainer_runtime.errors import ConfigurationError


class FeatureContainer(UserDict):
    """A mapping-like container such as a processor's BatchFeature (a UserDict)."""


class KeysOnly:
    """Not a Mapping, but has keys() and __getitem__."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def keys(self) -> list[str]:
        return list(self._data)

    def __getitem__(self, key: str) -> Any:
        return self._data[key]


@pytest.mark.parametrize(
    ("item", "kwargs", "expected"),
    [
        ({"input_ids": [1, 2, 3]}, {}, 3),
        ({"labels": [1], "input_ids": [1, 2, 3, 4]}, {}, 4),  # model input preferred over first
        ({"pixel_values": torch.zeros(7, 3)}, {}, 7),  # first value when no input_ids
        ({"input_ids": [1, 2], "length": 9}, {"length_column_name": "length"}, 9),
        ({"input_ids": [1, 2], "length": 9}, {}, 2),  # no column name given: measure
        ({"x": [1, 2, 3], "ids": [5]}, {"model_input_name": "ids"}, 1),
        (FeatureContainer(input_ids=torch.ones(1, 11)), {}, 11),  # leading batch dim of 1
        (KeysOnly({"input_ids": np.zeros(5)}), {}, 5),
        ((torch.arange(6), 1), {}, 6),  # (input, label) tuple: first element
        (torch.arange(4), {}, 4),
        ([1, 2, 3, 4, 5], {}, 5),
        ({"input_ids": []}, {}, 0),
    ],
)
def test_item_length(item: Any, kwargs: dict[str, Any], expected: int) -> None:
    assert item_length(item, **kwargs) == expected


@pytest.mark.parametrize(
    "item",
    [{"input_ids": 3}, {"input_ids": torch.tensor(3)}, 5, {}, (), {"input_ids": "text"}],
)
def test_item_length_errors_name_the_problem(item: Any) -> None:
    with pytest.raises(ConfigurationError, match="cannot infer the length"):
        item_length(item, index=4)


def test_infer_lengths_scans_map_style_dataset() -> None:
    data = [{"input_ids": list(range(n))} for n in (3, 1, 4, 1, 5)]
    assert infer_lengths(data) == [3, 1, 4, 1, 5]


def test_infer_lengths_uses_length_key_of_items() -> None:
    data = [{"input_ids": [0], "n_tokens": n} for n in (8, 2)]
    assert infer_lengths(data, length_column_name="n_tokens") == [8, 2]


class ColumnDataset:
    """Column access like a datasets.Dataset; reading an item is an error."""

    column_names = ("input_ids", "length")

    def __len__(self) -> int:
        return 3

    def __getitem__(self, key: Any) -> Any:
        if key == "length":
            return [10, 20, 30]
        raise AssertionError(f"item {key!r} read although a length column exists")


def test_infer_lengths_reads_length_column_without_touching_items() -> None:
    assert infer_lengths(ColumnDataset()) == [10, 20, 30]


def test_infer_lengths_with_real_hf_dataset() -> None:
    import datasets  # a dev dependency: a missing install fails here instead of skipping

    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [1, 2, 3]], "len": [7, 8]})
    assert infer_lengths(ds, length_column_name="len") == [7, 8]
    assert infer_lengths(ds, length_column_name="missing") == [2, 3]


def test_infer_lengths_needs_known_length() -> None:
    def stream() -> Any:
        yield {"input_ids": [1]}

    with pytest.raises(ConfigurationError, match="known length"):
        infer_lengths(stream())


@pytest.mark.parametrize(("lengths", "cost"), [([], 0), ([3], 3), ([2, 5, 1], 15), ([4, 4], 8)])
def test_padded_cost(lengths: list[int], cost: int) -> None:
    assert padded_cost(lengths) == cost
