"""Activation (gradient) checkpointing on real transformers models, side by side with
transformers' Trainer: enabled through the model's own ``activation_checkpointing_enable``, the
same losses, the same layers checkpointed (``every_n_layers``), the cache off while training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.transformers import models
from tests.transformers.side_by_side import both, make_trainer, train_losses


def _checkpointed_layers(model: Any) -> list[bool]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [
        bool(m.gradient_checkpointing)
        for m in model.modules()
        if isinstance(m, GradientCheckpointingLayer)
    ]


def _run(which: str, kind: str, tok: Any, out: Path, args: dict[str, Any]) -> tuple[Any, ...]:
    from transformers import DataCollatorForLanguageModeling

    model = (models.gpt2 if kind == "gpt2" else models.llama)(tok)
    trainer = make_trainer(
        which,
        out,
        args=args,
        model=model,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        train_dataset=models.causal_lm_dataset(tok),
    )
    losses = train_losses(trainer)
    return losses, _checkpointed_layers(model), model.config.use_cache


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("flag", ["gradient_checkpointing", "activation_checkpointing"])
def test_checkpointing_trains_like_transformers(
    kind: str, flag: str, tok: Any, tmp_path: Path
) -> None:
    runs = both(lambda which: _run(which, kind, tok, tmp_path, {flag: True}))
    (ref_losses, ref_layers, ref_cache), (losses, layers, cache) = (
        runs["transformers"],
        runs["ours"],
    )
    assert ref_layers == [True, True]  # the reference really checkpointed both layers
    assert layers == ref_layers
    assert cache is ref_cache is False
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_checkpointing_kwargs_every_n_layers_like_transformers(tok: Any, tmp_path: Path) -> None:
    args = {
        "activation_checkpointing": True,
        "activation_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2},
    }
    runs = both(lambda which: _run(which, "llama", tok, tmp_path, args))
    assert runs["transformers"][1] == [True, False]
    assert runs["ours"][1] == runs["transformers"][1]
    assert runs["ours"][0] == pytest.approx(runs["transformers"][0], rel=1e-6)


def test_checkpointing_loses_nothing_against_a_plain_run(tok: Any, tmp_path: Path) -> None:
    """Recomputing activations in backward changes no loss (our Trainer alone)."""
    plain = _run("ours", "gpt2", tok, tmp_path, {})
    checkpointed = _run("ours", "gpt2", tok, tmp_path, {"activation_checkpointing": True})
    assert plain[1] == [False, False] and checkpointed[1] == [True, True]
    assert checkpointed[0] == pytest.approx(plain[0], rel=1e-6)
