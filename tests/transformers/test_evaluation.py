"""evaluate() / predict() on real generative models, side by side with transformers' Trainer:
the same eval_loss, the same predictions (logits, no KV cache), ``ignore_keys`` and
``keys_to_ignore_at_inference`` honoured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.transformers import models
from tests.transformers.side_by_side import assert_nested_close, both, make_trainer


def _setup(kind: str, tok: Any) -> dict[str, Any]:
    """Model, collator and eval set; the causal-LM sets still carry their raw ``text`` column."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    if kind == "t5":
        return {
            "model": models.t5(tok),
            "data_collator": DataCollatorForSeq2Seq(tok),
            "dataset": models.seq2seq_dataset(tok, n=10),
        }
    build = models.gpt2 if kind == "gpt2" else models.llama
    return {
        "model": build(tok),
        "data_collator": DataCollatorForLanguageModeling(tok, mlm=False),
        "dataset": models.causal_lm_dataset(tok, n=10),
    }


def _predict(which: str, kind: str, tok: Any, out: Path, **predict_kwargs: Any) -> Any:
    setup = _setup(kind, tok)
    dataset = setup.pop("dataset")
    trainer = make_trainer(which, out, eval_dataset=dataset, **setup)
    metrics = trainer.evaluate()
    return metrics, trainer.predict(dataset, **predict_kwargs)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5"])
def test_evaluate_and_predict_match_transformers(kind: str, tok: Any, tmp_path: Path) -> None:
    runs = both(lambda which: _predict(which, kind, tok, tmp_path))
    (ref_metrics, ref), (metrics, ours) = runs["transformers"], runs["ours"]
    assert metrics["eval_loss"] == pytest.approx(ref_metrics["eval_loss"], rel=1e-6)
    assert ours.metrics["test_loss"] == pytest.approx(ref.metrics["test_loss"], rel=1e-6)
    # Logits (T5: logits and the encoder's last hidden state), batches right-padded with -100.
    assert_nested_close(ours.predictions, ref.predictions)
    np.testing.assert_array_equal(ours.label_ids, ref.label_ids)
    first = ours.predictions[0] if kind == "t5" else ours.predictions
    assert first.shape[0] == 10 and first.shape[-1] == len(tok)


def test_ignore_keys_argument_and_config_keys(tok: Any, tmp_path: Path) -> None:
    # T5 returns its EncoderDecoderCache under "cache" even with use_cache=False, so a list that
    # replaces the default ["cache"] names it too (transformers fails to gather it otherwise).
    ignore = ["cache", "encoder_last_hidden_state"]

    def run(which: str) -> tuple[Any, Any]:
        setup = _setup("t5", tok)
        dataset = setup.pop("dataset")
        trainer = make_trainer(which, tmp_path, **setup)
        by_argument = trainer.predict(dataset, ignore_keys=ignore)
        trainer.model.config.keys_to_ignore_at_inference = ignore
        by_config = trainer.predict(dataset)
        return by_argument.predictions, by_config.predictions

    runs = both(run)
    for ours, ref in zip(runs["ours"], runs["transformers"], strict=True):
        assert isinstance(ref, np.ndarray)  # only the logits are left
        assert_nested_close(ours, ref)


def test_a_cache_is_never_a_prediction(tok: Any, tmp_path: Path) -> None:
    """Deliberate difference: ignore_keys without "cache" still leaves the KV cache out (it
    cannot be concatenated); transformers raises a TypeError there."""
    setup = _setup("t5", tok)
    dataset = setup.pop("dataset")
    trainer = make_trainer("ours", tmp_path, **setup)
    expected = trainer.predict(dataset, ignore_keys=["cache", "encoder_last_hidden_state"])
    got = trainer.predict(dataset, ignore_keys=["encoder_last_hidden_state"])
    assert_nested_close(got.predictions, expected.predictions, atol=0)


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_use_cache_on_gives_no_cache_in_predictions(kind: str, tok: Any, tmp_path: Path) -> None:
    """With the model's cache turned on after the Trainer was built, outputs carry a
    DynamicCache / EncoderDecoderCache under ``cache``: it is not a prediction."""

    def run(which: str) -> Any:
        setup = _setup(kind, tok)
        dataset = setup.pop("dataset")
        trainer = make_trainer(which, tmp_path, **setup)
        trainer.model.config.use_cache = True
        return trainer.predict(dataset)

    runs = both(run)
    assert_nested_close(runs["ours"].predictions, runs["transformers"].predictions)
    assert runs["ours"].metrics["test_loss"] == pytest.approx(
        runs["transformers"].metrics["test_loss"], rel=1e-6
    )


def test_use_cache_is_off_after_init_like_transformers(tok: Any, tmp_path: Path) -> None:
    def run(which: str) -> bool:
        model = models.gpt2(tok)
        assert model.config.use_cache is True
        make_trainer(which, tmp_path, model=model)
        return model.config.use_cache

    assert both(run) == {"transformers": False, "ours": False}
