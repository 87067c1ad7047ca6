from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer_runtime.data.defaults import default_data_collator


def test_stacks_tensors_numbers_lists_and_renames_label() -> None:
    features = [
        {"x": torch.tensor([1.0, 2.0]), "label": 1, "w": 0.5, "ids": [1, 2, 3], "arr": np.ones(2)},
        {"x": torch.tensor([3.0, 4.0]), "label": 0, "w": 1.5, "ids": [4, 5, 6], "arr": np.zeros(2)},
    ]
    batch = default_data_collator(features)
    assert torch.equal(batch["x"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [1, 0]
    assert batch["w"].dtype == torch.float32
    assert batch["ids"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert batch["arr"].shape == (2, 2)


def test_ragged_lists_fail_with_a_fix() -> None:
    with pytest.raises(ValueError, match=r"cannot collate field 'ids'.*pad them"):
        default_data_collator([{"ids": [1, 2]}, {"ids": [1]}])


def test_non_mapping_examples() -> None:
    batch = default_data_collator([(torch.zeros(2), 1), (torch.ones(2), 0)])
    assert batch["0"].shape == (2, 2) and batch["1"].tolist() == [1, 0]
    with pytest.raises(TypeError, match="expects mappings"):
        default_data_collator([3, 4])
    with pytest.raises(ValueError, match="empty batch"):
        default_data_collator([])
