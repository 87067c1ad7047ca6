"""NEFTune: noise on the embeddings in training mode only, fully removed afterwards."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainer_runtime.data.neftune import (
    activate_neftune,
    deactivate_neftune,
    enable_neftune,
    find_input_embeddings,
    neftune_noise,
)
from trainer_runtime.errors import ConfigurationError


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids))


class NoGetter(nn.Module):
    def __init__(self, n_embeddings: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(10, 4) for _ in range(n_embeddings))


def hooks_of(module: nn.Module) -> int:
    return len(module._forward_hooks) + len(module._forward_pre_hooks)


@pytest.fixture
def model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


IDS = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))


def test_noise_in_train_mode_with_documented_scale(model: TinyLM) -> None:
    alpha = 5.0
    clean = model.embed(IDS).detach()
    model.train()
    with enable_neftune(model, alpha):
        noisy = model.embed(IDS).detach()
    bound = alpha / math.sqrt(IDS.shape[1] * 16)
    diff = noisy - clean
    assert diff.abs().max() <= bound + 1e-6
    assert diff.abs().max() > 0.5 * bound  # uniform over [-bound, bound]: reaches near the edge
    assert abs(diff.mean().item()) < 0.2 * bound  # centred
    # Variance of U(-b, b) is b^2/3.
    assert diff.var().item() == pytest.approx(bound**2 / 3, rel=0.25)


def test_no_noise_in_eval_mode(model: TinyLM) -> None:
    model.eval()
    before = model(IDS)
    with enable_neftune(model, 10.0):
        during = model(IDS)
    assert torch.equal(before, during)


def test_train_outputs_differ_from_eval_and_gradients_flow(model: TinyLM) -> None:
    with enable_neftune(model, 10.0):
        model.train()
        train_out = model(IDS)
        model.eval()
        eval_out = model(IDS)
        model.train()
        train_out.sum().backward()
    assert not torch.allclose(train_out, eval_out)
    assert model.embed.weight.grad is not None


def test_full_restoration_after_exit_and_after_exception(model: TinyLM) -> None:
    model.train()
    base = hooks_of(model.embed)
    expected = model(IDS).detach()
    with enable_neftune(model, 5.0):
        assert hooks_of(model.embed) == base + 1
    assert hooks_of(model.embed) == base
    assert torch.equal(model(IDS), expected)

    with pytest.raises(RuntimeError, match="boom"), enable_neftune(model, 5.0):
        raise RuntimeError("boom")
    assert hooks_of(model.embed) == base
    assert torch.equal(model(IDS), expected)
    assert set(vars(model.embed)) == set(vars(TinyLM().embed))  # no attribute left behind
    # And it can be activated again (nothing thinks it is still active).
    with enable_neftune(model, 5.0):
        pass


def test_activate_deactivate_pair(model: TinyLM) -> None:
    handle = activate_neftune(model, 5.0)
    assert handle.active
    with pytest.raises(ConfigurationError, match="already active"):
        activate_neftune(model, 5.0)
    deactivate_neftune(handle)
    deactivate_neftune(handle)  # idempotent
    assert not handle.active
    assert hooks_of(model.embed) == 0


def test_noise_follows_the_torch_rng(model: TinyLM) -> None:
    """The runtime checkpoints the global torch RNG, so resumed runs get the same noise."""
    model.train()
    with enable_neftune(model, 5.0):
        torch.manual_seed(123)
        a = model(IDS)
        torch.manual_seed(123)
        b = model(IDS)
    assert torch.equal(a, b)


@pytest.mark.parametrize("alpha", [0, -1.0, float("inf"), float("nan"), True, "5"])
def test_bad_alpha(model: TinyLM, alpha: object) -> None:
    with pytest.raises(ConfigurationError, match="neftune_noise_alpha"):
        activate_neftune(model, alpha)  # type: ignore[arg-type]
    assert hooks_of(model.embed) == 0


def test_alpha_none_is_a_no_op(model: TinyLM) -> None:
    with enable_neftune(model, None) as handle:
        assert handle is None
        assert hooks_of(model.embed) == 0


def test_find_input_embeddings() -> None:
    assert isinstance(find_input_embeddings(NoGetter(1)), nn.Embedding)
    with pytest.raises(ConfigurationError, match="get_input_embeddings"):
        find_input_embeddings(NoGetter(2))
    model = NoGetter(2)
    with enable_neftune(model, 5.0, embedding=model.tables[1]):
        assert hooks_of(model.tables[1]) == 1 and hooks_of(model.tables[0]) == 0


def test_neftune_noise_needs_a_sequence_dimension() -> None:
    with pytest.raises(ConfigurationError, match="seq_len"):
        neftune_noise(torch.zeros(4), 5.0)
