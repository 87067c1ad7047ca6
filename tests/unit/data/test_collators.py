"""PaddingCollator: variable-length examples -> padded tensors with an attention mask."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from trainer_runtime.data.collators import PaddingCollator
from trainer_runtime.errors import ConfigurationError


def test_right_padding_with_mask_and_labels() -> None:
    batch = PaddingCollator(pad_token_id=9)(
        [
            {"input_ids": [1, 2, 3], "labels": [1, 2, 3]},
            {"input_ids": [4], "labels": [4]},
        ]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long


def test_left_padding_and_multiple_of() -> None:
    collate = PaddingCollator(padding_side="left", pad_to_multiple_of=4)
    batch = collate([{"input_ids": torch.tensor([5, 6])}, {"input_ids": torch.tensor([7])}])
    assert batch["input_ids"].tolist() == [[0, 0, 5, 6], [0, 0, 0, 7]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]


def test_existing_mask_is_padded_with_zero_and_scalars_are_stacked() -> None:
    batch = PaddingCollator(pad_token_id=3)(
        [
            {"input_ids": [1, 1], "attention_mask": [1, 1], "label": 0, "text": "a"},
            {"input_ids": [2], "attention_mask": [1], "label": 1, "text": "b"},
        ]
    )
    assert batch["attention_mask"].tolist() == [[1, 1], [1, 0]]
    assert batch["labels"].tolist() == [0, 1]  # label -> labels
    assert batch["text"] == ["a", "b"]


def test_feature_dimension_is_kept() -> None:
    batch = PaddingCollator(pad_values={"pixel_values": -1.0})(
        [{"pixel_values": np.ones((3, 2), dtype=np.float32)}, {"pixel_values": np.ones((1, 2))}]
    )
    assert batch["pixel_values"].shape == (2, 3, 2)
    assert batch["pixel_values"][1, 1:].eq(-1).all()
    assert "attention_mask" not in batch  # no input_ids to derive it from


def test_pads_what_a_length_sampler_batches() -> None:
    from trainer_runtime.data.length_sampling import BatchRebalanceBatchSampler

    data = [{"input_ids": list(range(n))} for n in (1, 9, 2, 7, 3, 3, 8, 1)]
    sampler = BatchRebalanceBatchSampler([len(d["input_ids"]) for d in data], 2, seed=0)
    collate = PaddingCollator()
    for indices in sampler:
        batch = collate([data[i] for i in indices])
        longest = max(len(data[i]["input_ids"]) for i in indices)
        assert batch["input_ids"].shape == (len(indices), longest)
        assert batch["attention_mask"].sum().item() == sum(
            len(data[i]["input_ids"]) for i in indices
        )


@pytest.mark.parametrize(
    ("features", "kwargs", "match"),
    [
        ([], {}, "empty batch"),
        ([[1, 2]], {}, "mapping examples"),
        ([{"input_ids": [1]}, {"labels": [1]}], {}, "same fields"),
        ([{"x": np.ones((2, 3))}, {"x": np.ones((2, 4))}], {}, "beyond the first dimension"),
        ([{"input_ids": [1]}], {"padding_side": "middle"}, "padding_side"),
        ([{"input_ids": [1]}], {"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
    ],
)
def test_errors(features: list[Any], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        PaddingCollator(**kwargs)(features)


class _Tokenizer:
    """A tokenizer stand-in: pad() right-pads input_ids with 0 and stacks the rest."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def pad(self, features: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        self.seen = kwargs
        longest = max(len(f["input_ids"]) for f in features)
        out = {
            "input_ids": torch.tensor(
                [f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]
            )
        }
        for key in features[0]:
            if key != "input_ids":
                out[key] = torch.tensor([f[key] for f in features])
        return out


def test_data_collator_with_padding_pads_through_the_tokenizer_and_renames_labels() -> None:
    from trainer_runtime.data.collators import DataCollatorWithPadding

    tok = _Tokenizer()
    batch = DataCollatorWithPadding(tok, pad_to_multiple_of=8)(
        [{"input_ids": [1, 2], "label": 1}, {"input_ids": [3], "label": 0}]
    )
    assert batch["input_ids"].tolist() == [[1, 2], [3, 0]]
    assert batch["labels"].tolist() == [1, 0] and "label" not in batch
    assert tok.seen == {
        "padding": True,
        "max_length": None,
        "pad_to_multiple_of": 8,
        "return_tensors": "pt",
    }
    with pytest.raises(ConfigurationError, match="pad"):
        DataCollatorWithPadding(object())


def test_default_collator_follows_processing_class() -> None:
    from trainer_runtime.data.collators import DataCollatorWithPadding
    from trainer_runtime.data.defaults import default_collator_for, default_data_collator

    assert default_collator_for(None) is default_data_collator
    assert default_collator_for(object()) is default_data_collator
    chosen = default_collator_for(_Tokenizer())
    assert isinstance(chosen, DataCollatorWithPadding)
