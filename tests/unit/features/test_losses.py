from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.unit.features.tiny_lm import TinyCausalLM, TinyClassifier, make_batches
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.losses import (
    LabelSmoother,
    compute_loss,
    count_items_in_batch,
    is_causal_lm,
    loss_is_scaled,
    model_accepts_loss_kwargs,
    scale_loss_for_gradient_accumulation,
)

LABELS = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100]])


@pytest.mark.parametrize(
    ("batches", "shift", "expected"),
    [
        ([{"labels": LABELS}], False, 4),
        # shifted: position 0 of each row has no target -> [6, 7] and [] -> 2
        ([{"labels": LABELS}], True, 2),
        ([{"labels": LABELS}, {"labels": LABELS}], True, 4),
        # already-shifted targets are counted as they are
        ([{"shift_labels": LABELS}], True, 4),
        ([{"input_ids": LABELS}], True, None),
        ([], True, None),
    ],
)
def test_count_items_in_batch(batches: list[dict[str, Any]], shift: bool, expected: int | None):
    assert count_items_in_batch(batches, shift_labels=shift) == expected


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_num_items_in_batch_makes_accumulation_exact():
    """Two micro-batches with uneven label counts give the gradient of the joined batch."""
    micro = make_batches(2, 2, lengths=[7, 2, 3, 5], seed=3)
    # The shifted-label count across the whole accumulation window: (7-1)+(2-1)+(3-1)+(5-1) = 13
    n = count_items_in_batch(micro, shift_labels=is_causal_lm(TinyCausalLM()))
    assert n == 13

    accumulated = TinyCausalLM()
    for batch in micro:
        loss, _ = compute_loss(accumulated, batch, num_items_in_batch=n)
        scaled = loss_is_scaled(
            None,
            model_accepts_loss_kwargs=model_accepts_loss_kwargs(accumulated),
            has_compute_loss_func=False,
            num_items_in_batch=n,
        )
        assert scaled
        scale_loss_for_gradient_accumulation(loss, 2, already_scaled=scaled).backward()

    joined = {k: torch.cat([b[k] for b in micro]) for k in micro[0]}
    whole = TinyCausalLM()
    loss, _ = compute_loss(whole, joined)
    loss.backward()
    for a, b in zip(_grads(accumulated), _grads(whole), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    # Without the count (per-batch means / GA steps) the gradient differs: the test can fail.
    naive = TinyCausalLM()
    for batch in micro:
        loss, _ = compute_loss(naive, batch)
        scale_loss_for_gradient_accumulation(loss, 2, already_scaled=False).backward()
    assert not all(
        torch.allclose(a, b, rtol=1e-4) for a, b in zip(_grads(naive), _grads(whole), strict=True)
    )


def test_compute_loss_func_gets_popped_labels_and_is_not_normalised():
    batch = make_batches(1, 2, lengths=[5, 3])[0]
    seen: dict[str, Any] = {}

    def my_loss(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        seen["has_model_loss"] = "loss" in outputs
        seen["labels"] = labels
        seen["n"] = num_items_in_batch
        logits = outputs["logits"][:, :-1].reshape(-1, outputs["logits"].shape[-1])
        total = F.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="sum")
        return total / num_items_in_batch

    model = TinyCausalLM()
    n = count_items_in_batch([batch], shift_labels=True)
    loss, _ = compute_loss(model, batch, num_items_in_batch=n, compute_loss_func=my_loss)
    # labels were removed before the forward pass, so the model computed no loss of its own
    assert seen["has_model_loss"] is False
    assert torch.equal(seen["labels"], batch["labels"])
    assert seen["n"] == n == 6
    scaled = loss_is_scaled(
        None, model_accepts_loss_kwargs=True, has_compute_loss_func=True, num_items_in_batch=n
    )
    # the Trainer uses the custom loss exactly as returned, whatever the GA steps
    assert scale_loss_for_gradient_accumulation(loss, 4, already_scaled=scaled) is loss


@pytest.mark.parametrize(
    ("flag", "accepts", "custom", "smoother", "n", "expected"),
    [
        (None, True, False, False, 10, True),
        (None, False, False, False, 10, False),
        (None, True, False, False, None, False),
        (None, False, True, False, None, True),
        (None, False, False, True, 10, True),
        (True, False, False, False, None, True),
        (False, True, True, False, 10, False),
    ],
)
def test_loss_is_scaled(flag, accepts, custom, smoother, n, expected):
    got = loss_is_scaled(
        flag,
        model_accepts_loss_kwargs=accepts,
        has_compute_loss_func=custom,
        num_items_in_batch=n,
        has_label_smoother=smoother,
    )
    assert got is expected


def test_scale_loss_divides_unscaled_loss_by_ga_steps():
    loss = torch.tensor(8.0)
    assert scale_loss_for_gradient_accumulation(loss, 4, already_scaled=False).item() == 2.0
    assert scale_loss_for_gradient_accumulation(loss, 4, already_scaled=True).item() == 8.0


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_label_smoother_matches_documented_targets(eps: float):
    """Targets: eps/C off the true class, 1 - eps + eps/C on it (= torch's label_smoothing)."""
    torch.manual_seed(0)
    logits = torch.randn(5, 4)
    labels = torch.tensor([0, 3, -100, 2, 1])
    got = LabelSmoother(eps)({"logits": logits}, labels)
    expected = F.cross_entropy(logits, labels, ignore_index=-100, label_smoothing=eps)
    torch.testing.assert_close(got, expected)
    # by hand for one row: soft target distribution dotted with -log p
    row_logp = torch.log_softmax(logits[0], dim=-1)
    target = torch.full((4,), eps / 4)
    target[0] += 1 - eps
    torch.testing.assert_close(
        LabelSmoother(eps)({"logits": logits[:1]}, labels[:1]), -(target * row_logp).sum()
    )


def test_label_smoother_in_compute_loss_shifts_for_causal_lm():
    batch = make_batches(1, 2, lengths=[6, 4])[0]
    model = TinyCausalLM()
    loss, outputs = compute_loss(model, batch, label_smoother=LabelSmoother(0.1))
    logits = outputs["logits"]
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch["labels"][:, 1:].reshape(-1),
        label_smoothing=0.1,
    )
    torch.testing.assert_close(loss, expected)

    clf = TinyClassifier()
    cbatch = {"input_ids": batch["input_ids"], "labels": torch.tensor([1, 3])}
    loss, outputs = compute_loss(clf, cbatch, label_smoother=LabelSmoother(0.2))
    torch.testing.assert_close(
        loss, F.cross_entropy(outputs["logits"], cbatch["labels"], label_smoothing=0.2)
    )


@pytest.mark.parametrize("eps", [-0.1, 1.0, 2])
def test_label_smoother_rejects_bad_factor(eps: float):
    with pytest.raises(ConfigurationError, match="label_smoothing_factor"):
        LabelSmoother(eps)


def test_model_introspection():
    assert model_accepts_loss_kwargs(TinyCausalLM()) is True
    assert model_accepts_loss_kwargs(TinyClassifier()) is False
    assert is_causal_lm(TinyCausalLM()) is True
    assert is_causal_lm(TinyClassifier()) is False
    clf = TinyClassifier()
    clf.is_causal_lm = True  # explicit attribute wins
    assert is_causal_lm(clf) is True


def test_default_path_without_labels_is_a_clear_error():
    batch = make_batches(1, 1, lengths=[3])[0]
    with pytest.raises(ValueError, match="did not return a loss"):
        compute_loss(TinyCausalLM(), {"input_ids": batch["input_ids"]})


def test_loss_multiplied_by_world_size_when_tokens_are_averaged_across_devices():
    batch = make_batches(1, 2, lengths=[5, 3])[0]
    model = TinyCausalLM()
    single, _ = compute_loss(model, batch, num_items_in_batch=6)
    multi, _ = compute_loss(
        model, batch, num_items_in_batch=6, world_size=4, average_tokens_across_devices=True
    )
    torch.testing.assert_close(multi, single * 4)
    off, _ = compute_loss(
        model, batch, num_items_in_batch=6, world_size=4, average_tokens_across_devices=False
    )
    torch.testing.assert_close(off, single)
