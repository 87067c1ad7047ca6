from __future__ import annotations

import random

import numpy as np
import torch

from trainer_runtime.checkpoint.rng import capture_rng_state, restore_rng_state


def draw() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn(), torch.rand(3))


def test_capture_restore_round_trip_all_generators() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draw()
    random.gauss(0, 1)  # leaves a cached gaussian in python's generator
    tensors, meta = capture_rng_state()
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert all(isinstance(v, str) for v in meta.values())  # safetensors metadata is str -> str
    expected = draw()
    draw()
    restore_rng_state(tensors, meta)
    got = draw()
    assert got[:4] == expected[:4]
    assert torch.equal(got[4], expected[4])


def test_round_trip_through_safetensors() -> None:
    from safetensors.torch import load, save

    torch.manual_seed(5)
    tensors, meta = capture_rng_state()
    data = save(tensors, metadata=meta)
    expected = torch.rand(4)
    restore_rng_state(dict(load(data)), meta)
    assert torch.equal(torch.rand(4), expected)
