from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer_runtime.features.optim import create_optimizer, decay_parameter_names
from trainer_runtime.training_args import TrainingArguments


class RMSNormLike(nn.Module):
    """A custom norm (not a torch class), recognised by its name like Llama's RMSNorm."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.rms = RMSNormLike(4)
        self.out = nn.Linear(4, 2, bias=False)
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)


def test_decay_excludes_bias_and_norms() -> None:
    assert sorted(decay_parameter_names(Net())) == ["embed.weight", "out.weight", "proj.weight"]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd"])
def test_optimizer_groups(optim: str) -> None:
    model = Net()
    args = TrainingArguments(output_dir="out", weight_decay=0.1, optim=optim)
    opt = create_optimizer(model, args)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decayed["params"]) == [
        "embed.weight",
        "out.weight",
        "proj.weight",
    ]
    assert "proj.bias" in {names[id(p)] for p in plain["params"]}
    assert "frozen.weight" not in {names[id(p)] for g in opt.param_groups for p in g["params"]}
    if optim == "adamw_torch_fused":
        assert decayed["fused"] is True


def test_decay_really_spares_bias() -> None:
    lin = nn.Linear(2, 2)
    args = TrainingArguments(
        output_dir="out", weight_decay=0.5, learning_rate=0.1, optim="adamw_torch"
    )
    opt = create_optimizer(lin, args)
    before_b = lin.bias.detach().clone()
    before_w = lin.weight.detach().clone()
    lin.weight.grad = torch.zeros_like(lin.weight)
    lin.bias.grad = torch.zeros_like(lin.bias)
    opt.step()
    assert torch.equal(lin.bias, before_b)  # zero grad, no decay: unchanged
    assert torch.allclose(lin.weight, before_w * (1 - 0.1 * 0.5))  # decoupled decay applied
