"""Which submodules become FSDP units (``wrap_targets``): a pure function of the model and the
config, so it is tested without a process group."""

from __future__ import annotations

import pytest
from torch import nn

from trainer_runtime.distributed.fsdp import FsdpConfig, wrap_targets
from trainer_runtime.errors import ConfigurationError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)  # 72 parameters
        self.mlp = nn.Linear(8, 32)  # 288 parameters


class Net(nn.Module):
    _no_split_modules = ("Block",)

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)  # 80 parameters
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)  # 18 parameters
        self.act = nn.ReLU()


def _names(model: nn.Module, config: FsdpConfig) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(m)] for m in wrap_targets(model, config)]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (FsdpConfig(), ["embed", "blocks", "head"]),  # children owning parameters
        (FsdpConfig(wrap="none"), []),
        (FsdpConfig(wrap="transformer"), ["blocks.0", "blocks.1"]),  # _no_split_modules
        (
            FsdpConfig(wrap="transformer", layer_classes=("Linear",)),
            ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp", "head"],
        ),
        (
            FsdpConfig(wrap="transformer", layer_classes=("Block", "Embedding")),
            ["embed", "blocks.0", "blocks.1"],
        ),
        # post-order: the 288-parameter mlp is a unit; the 72 left in each block are too few
        (FsdpConfig(wrap="size", min_num_params=200), ["blocks.0.mlp", "blocks.1.mlp"]),
        (
            FsdpConfig(wrap="size", min_num_params=70),
            ["embed", "blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"],
        ),
        (FsdpConfig(wrap="size", min_num_params=300), ["blocks.0", "blocks.1"]),
        (FsdpConfig(wrap="size", min_num_params=10_000), []),
    ],
)
def test_wrap_targets(config: FsdpConfig, expected: list[str]) -> None:
    assert _names(Net(), config) == expected


@pytest.mark.parametrize(
    ("model", "config", "needle"),
    [
        (nn.Sequential(nn.Linear(2, 2)), FsdpConfig(wrap="transformer"), "no layer classes"),
        (Net(), FsdpConfig(wrap="transformer", layer_classes=("Decoder",)), "no such module"),
        (Net(), FsdpConfig(wrap="size"), "min_num_params > 0"),
    ],
)
def test_wrap_targets_refusals(model: nn.Module, config: FsdpConfig, needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        wrap_targets(model, config)
