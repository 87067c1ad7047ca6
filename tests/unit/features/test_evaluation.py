from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit.features.tiny_lm import VOCAB, TinyCausalLM, make_batches
from trainer_runtime.features.best import metric_key
from trainer_runtime.features.evaluation import (
    EvalPrediction,
    PredictionAccumulator,
    default_ignore_keys,
    evaluate_datasets,
    evaluation_loop,
    nested_concat,
    prediction_step,
    prefix_metrics,
    should_evaluate_at_epoch_end,
    should_evaluate_at_step,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _on(batches: list[dict[str, torch.Tensor]], device: str) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in b.items()} for b in batches]


def _step(**kw: Any) -> Any:
    return functools.partial(prediction_step, prediction_loss_only=False, **kw)


def argmax_logits(logits: Any, labels: Any) -> torch.Tensor:
    # the recipe's preprocess_logits_for_metrics
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def recipe_accuracy(eval_preds: EvalPrediction) -> dict[str, float]:
    preds, labels = eval_preds  # unpacks to two elements when no extras were asked for
    labels = labels[:, 1:].reshape(-1)
    preds = preds[:, :-1].reshape(-1)
    keep = labels != -100
    return {"accuracy": float((preds[keep] == labels[keep]).mean())}


@pytest.mark.parametrize("device", DEVICES)
def test_preprocess_logits_shrinks_what_is_accumulated(device: str):
    model = TinyCausalLM().to(device)
    batches = _on(make_batches(4, 3, lengths=[6, 4, 5]), device)
    full: dict[str, PredictionAccumulator] = {}
    small: dict[str, PredictionAccumulator] = {}
    out_full = evaluation_loop(model, batches, step=_step(), accumulators=full)
    out_small = evaluation_loop(
        model,
        batches,
        step=_step(),
        preprocess_logits_for_metrics=argmax_logits,
        compute_metrics=recipe_accuracy,
        accumulators=small,
    )
    assert out_full.predictions.shape == (12, 6, VOCAB)
    assert out_small.predictions.shape == (12, 6)
    # the per-batch argmax replaced the logits before accumulation: VOCAB times less held
    assert small["preds"].peak_device_numel * VOCAB == full["preds"].peak_device_numel
    np.testing.assert_array_equal(out_small.predictions, out_full.predictions.argmax(-1))
    assert 0.0 <= out_small.metrics["eval_accuracy"] <= 1.0
    assert out_small.metrics["eval_loss"] == pytest.approx(out_full.metrics["eval_loss"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("accumulation", "transfers", "peak_batches"), [(None, 1, 5), (2, 3, 2), (1, 5, 1)]
)
def test_eval_accumulation_steps_moves_to_host_every_n_batches(
    device: str, accumulation: int | None, transfers: int, peak_batches: int
):
    model = TinyCausalLM().to(device)
    batches = _on(make_batches(5, 2, lengths=[4]), device)
    acc: dict[str, PredictionAccumulator] = {}
    out = evaluation_loop(
        model, batches, step=_step(), eval_accumulation_steps=accumulation, accumulators=acc
    )
    per_batch = 2 * 4 * VOCAB
    assert acc["preds"].host_transfers == transfers
    assert acc["preds"].peak_device_numel == peak_batches * per_batch
    assert acc["labels"].host_transfers == transfers
    assert isinstance(out.predictions, np.ndarray)  # on the host at the end
    assert out.predictions.shape == (10, 4, VOCAB)
    assert out.num_samples == 10


def test_eval_do_concat_batches_false_keeps_batches_apart():
    model = TinyCausalLM()
    batches = make_batches(2, 2, lengths=[3]) + make_batches(1, 2, lengths=[5])
    out = evaluation_loop(model, batches, step=_step(), eval_do_concat_batches=False)
    assert isinstance(out.predictions, list) and len(out.predictions) == 3
    assert [p.shape for p in out.predictions] == [(2, 3, VOCAB), (2, 3, VOCAB), (2, 5, VOCAB)]
    # concatenated: shorter batches are right-padded with -100
    cat = evaluation_loop(model, batches, step=_step())
    assert cat.label_ids.shape == (6, 5)
    assert (cat.label_ids[:4, 3:] == -100).all()


def test_include_for_metrics_inputs_and_loss():
    model = TinyCausalLM()
    batches = make_batches(3, 2, lengths=[4, 3])
    seen: dict[str, Any] = {}

    def metrics(ep: EvalPrediction) -> dict[str, float]:
        seen["len"] = len(ep)
        seen["inputs"] = ep.inputs
        seen["losses"] = ep.losses
        return {"mean_loss": float(np.mean(ep.losses))}

    out = evaluation_loop(
        model,
        batches,
        step=_step(),
        compute_metrics=metrics,
        include_for_metrics=["inputs", "loss"],
    )
    assert seen["len"] == 4
    np.testing.assert_array_equal(seen["inputs"], torch.cat([b["input_ids"] for b in batches]))
    assert seen["losses"].shape == (6,)  # one loss per sample
    assert out.metrics["eval_mean_loss"] == pytest.approx(out.metrics["eval_loss"])

    with pytest.raises(ValueError, match="include_for_metrics"):
        evaluation_loop(model, batches, step=_step(), include_for_metrics=["logits"])


@pytest.mark.parametrize("sized", [True, False])
def test_batch_eval_metrics_calls_compute_metrics_per_batch(sized: bool):
    model = TinyCausalLM()
    batches = make_batches(4, 2, lengths=[5, 3])
    source = batches if sized else iter(batches)  # without len: the last batch is found ahead
    calls: list[bool] = []
    state = {"correct": 0, "total": 0}

    def running_accuracy(ep: EvalPrediction, compute_result: bool) -> dict[str, float]:
        calls.append(compute_result)
        preds = ep.predictions.argmax(-1)[:, :-1]
        labels = ep.label_ids[:, 1:]
        keep = labels != -100
        state["correct"] += int((preds[keep] == labels[keep]).sum())
        state["total"] += int(keep.sum())
        if compute_result:
            return {"accuracy": state["correct"] / state["total"]}
        return {}

    acc: dict[str, PredictionAccumulator] = {}
    out = evaluation_loop(
        model,
        source,
        step=_step(),
        compute_metrics=running_accuracy,
        batch_eval_metrics=True,
        accumulators=acc,
    )
    assert calls == [False, False, False, True]
    assert out.predictions is None and acc["preds"].peak_device_numel == 0
    reference = evaluation_loop(
        model,
        batches,
        step=_step(),
        preprocess_logits_for_metrics=argmax_logits,
        compute_metrics=recipe_accuracy,
    )
    assert out.metrics["eval_accuracy"] == pytest.approx(reference.metrics["eval_accuracy"])
    assert "eval_loss" in out.metrics


def test_prediction_loss_only_returns_only_the_loss():
    model = TinyCausalLM()
    called = []
    out = evaluation_loop(
        model,
        make_batches(2, 2, lengths=[4]),
        step=functools.partial(prediction_step, prediction_loss_only=True),
        compute_metrics=lambda ep: called.append(1) or {},
    )
    assert out.predictions is None and out.label_ids is None and not called
    assert out.num_samples == 4
    assert set(out.metrics) == {"eval_loss"} and math.isfinite(out.metrics["eval_loss"])


class SpanModel(nn.Module):
    """QA-style model with two label inputs, none called 'labels'."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 4)
        self.start = nn.Linear(4, 1)
        self.end = nn.Linear(4, 1)

    def forward(self, input_ids, start_positions=None, end_positions=None):
        h = self.embed(input_ids)
        s, e = self.start(h).squeeze(-1), self.end(h).squeeze(-1)
        out = {"start_logits": s, "end_logits": e}
        if start_positions is not None:
            ce = nn.functional.cross_entropy
            out["loss"] = (ce(s, start_positions) + ce(e, end_positions)) / 2
        return out


def test_label_names_select_the_label_inputs():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3], [4, 5, 6]]),
        "start_positions": torch.tensor([0, 1]),
        "end_positions": torch.tensor([2, 2]),
    }
    names = ["start_positions", "end_positions"]
    loss, logits, labels = prediction_step(
        SpanModel(), batch, prediction_loss_only=False, label_names=names
    )
    assert loss is not None and loss.ndim == 0
    assert isinstance(logits, tuple) and len(logits) == 2  # loss removed, both heads kept
    assert torch.equal(labels[0], batch["start_positions"])
    assert torch.equal(labels[1], batch["end_positions"])
    # with the default label name nothing counts as a label: no loss, no labels
    loss, logits, labels = prediction_step(SpanModel(), batch, prediction_loss_only=False)
    assert loss is None and labels is None
    # ignore_keys drops outputs from the predictions
    _, logits, _ = prediction_step(
        SpanModel(),
        batch,
        prediction_loss_only=False,
        label_names=names,
        ignore_keys=["end_logits"],
    )
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 3)


def test_metric_key_prefix_and_dict_of_eval_datasets():
    model = TinyCausalLM()
    sets = {"short": make_batches(2, 2, lengths=[3]), "long": make_batches(2, 2, lengths=[9])}

    def evaluate_one(batches: Any, prefix: str) -> dict[str, Any]:
        return evaluation_loop(
            model,
            batches,
            step=_step(),
            preprocess_logits_for_metrics=argmax_logits,
            compute_metrics=recipe_accuracy,
            metric_key_prefix=prefix,
        ).metrics

    metrics = evaluate_datasets(sets, evaluate_one)
    assert set(metrics) == {
        "eval_short_loss",
        "eval_short_accuracy",
        "eval_long_loss",
        "eval_long_accuracy",
    }
    assert metrics["eval_short_loss"] != metrics["eval_long_loss"]
    # metric_for_best_model names one of the datasets exactly
    assert metric_key("eval_long_loss") in metrics
    assert set(evaluate_datasets(sets["short"], evaluate_one, "test")) == {
        "test_loss",
        "test_accuracy",
    }


def test_prefix_metrics_prefixes_once_and_converts_scalars():
    got = prefix_metrics({"acc": np.float32(0.5), "eval_f1": torch.tensor(1.0), "n": 3}, "eval")
    assert got == {"eval_acc": 0.5, "eval_f1": 1.0, "eval_n": 3}
    assert all(type(v) in (float, int) for v in got.values())


@pytest.mark.parametrize(("nan_filter", "finite"), [(True, True), (False, False)])
def test_eval_loss_nan_inf_filter(nan_filter: bool, finite: bool):
    model = TinyCausalLM()
    batches = make_batches(2, 2, lengths=[4])
    empty = make_batches(1, 2, lengths=[4])[0]
    empty["labels"] = torch.full_like(empty["labels"], -100)  # no target: loss is NaN
    out = evaluation_loop(model, [*batches, empty], step=_step(), nan_inf_filter=nan_filter)
    assert math.isfinite(out.metrics["eval_loss"]) is finite
    if finite:
        clean = evaluation_loop(model, batches, step=_step())
        assert out.metrics["eval_loss"] == pytest.approx(clean.metrics["eval_loss"])


def test_eval_prediction_iterates_present_elements():
    ep = EvalPrediction(np.zeros(2), np.ones(2))
    preds, labels = ep
    assert len(ep) == 2 and (labels == 1).all() and (preds == 0).all()
    assert len(EvalPrediction(1, 2, inputs=3)) == 3
    assert EvalPrediction(1, 2, losses=4)[2] == 4


def test_nested_concat_pads_and_rejects_mismatch():
    a = torch.ones(2, 3)
    b = torch.zeros(1, 5)
    out = nested_concat({"x": (a,)}, {"x": (b,)})
    assert out["x"][0].shape == (3, 5)
    assert (out["x"][0][:2, 3:] == -100).all()
    with pytest.raises(ValueError, match="eval_do_concat_batches"):
        nested_concat(torch.ones(1, 2, 3), torch.ones(1, 2, 4))


@pytest.mark.parametrize(
    ("strategy", "step", "every", "delay", "expected"),
    [
        ("steps", 10, 5, 0, True),
        ("steps", 11, 5, 0, False),
        ("steps", 10, 5, 20, False),
        ("epoch", 10, 5, 0, False),
        ("no", 10, 5, 0, False),
    ],
)
def test_should_evaluate_at_step(strategy, step, every, delay, expected):
    assert should_evaluate_at_step(strategy, step, every, delay) is expected


@pytest.mark.parametrize(
    ("strategy", "epoch", "delay", "expected"),
    [("epoch", 1.0, 0, True), ("epoch", 1.0, 2, False), ("steps", 1.0, 0, False)],
)
def test_should_evaluate_at_epoch_end(strategy, epoch, delay, expected):
    assert should_evaluate_at_epoch_end(strategy, epoch, delay) is expected


def test_default_ignore_keys_follow_the_model_config() -> None:
    class Config:
        pass

    model = nn.Linear(2, 2)
    assert default_ignore_keys(model) == []
    model.config = Config()  # type: ignore[assignment]
    assert default_ignore_keys(model) == ["cache"]  # transformers' default
    model.config.keys_to_ignore_at_inference = ["mems"]  # type: ignore[attr-defined]
    assert default_ignore_keys(model) == ["mems"]


def test_kv_cache_outputs_are_not_predictions() -> None:
    cache_utils = pytest.importorskip("transformers.cache_utils")

    class CachingModel(nn.Module):
        def forward(self, input_ids: torch.Tensor) -> dict[str, Any]:
            logits = input_ids.float().unsqueeze(-1)
            # A cache under a name no ignore list holds (older models: past_key_values).
            return {"logits": logits, "past_key_values": cache_utils.DynamicCache()}

    batch = {"input_ids": torch.tensor([[1, 2], [3, 4]])}
    _, logits, _ = prediction_step(CachingModel(), batch, prediction_loss_only=False)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 2, 1)


@pytest.mark.parametrize(
    ("weighting", "rows"),
    [("sample", [5, 5, 2]), ("batch", [5, 5, 2]), ("sample", [4, 4]), ("batch", [4, 4])],
)
def test_eval_loss_weighs_samples_or_batches(weighting: str, rows: list[int]):
    """ "sample": every sample once (a short last batch by its size); "batch": every batch once
    (transformers' Seq2SeqTrainer); the two agree when every batch is full."""
    model = TinyCausalLM()
    batches = [make_batches(1, n, lengths=[5], seed=i)[0] for i, n in enumerate(rows)]
    step = _step()
    per_batch = [float(step(model, b)[0]) for b in batches]
    out = evaluation_loop(model, batches, step=step, loss_weighting=weighting)  # type: ignore[arg-type]
    weights = rows if weighting == "sample" else [1] * len(rows)
    expected = sum(w * loss for w, loss in zip(weights, per_batch, strict=True)) / sum(weights)
    assert out.metrics["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert out.num_samples == sum(rows)


def test_eval_loss_weighting_rejects_unknown():
    with pytest.raises(ValueError, match="loss_weighting='tokens'"):
        evaluation_loop(TinyCausalLM(), [], step=_step(), loss_weighting="tokens")  # type: ignore[arg-type]
