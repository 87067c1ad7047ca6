"""Checkpoints and save_model() of real transformers models open with from_pretrained.

A checkpoint of a PreTrainedModel holds what transformers' save_pretrained writes (config.json,
generation_config.json, model.safetensors with the same tensor names and tied-weight handling)
plus the processing class's files, all listed in our manifest (fsynced, complete by our rule).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.transformers.ckpt_support import (
    OURS,
    THEIRS,
    assert_same_state,
    build_model,
    causal_data,
    classification_data,
    collator_for,
    listed_files,
    losses,
    make_trainer,
    safetensors_names,
)
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.testing import drop_from_page_cache

KINDS = ["gpt2", "llama", "bert_classifier"]


def _auto_class(kind: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if kind == "bert_classifier" else AutoModelForCausalLM


def _data(kind: str, tok):
    return classification_data(tok) if kind == "bert_classifier" else causal_data(tok)


def _assert_opens_as_trained(path: Path, kind: str, trained, tok) -> None:
    from transformers import AutoTokenizer

    loaded, info = _auto_class(kind).from_pretrained(str(path), output_loading_info=True)
    assert type(loaded) is type(trained)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert_same_state(loaded.state_dict(), trained.state_dict())
    reloaded_tok = AutoTokenizer.from_pretrained(str(path))
    text = "the red cat runs fast"
    assert reloaded_tok(text)["input_ids"] == tok(text)["input_ids"]


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_and_save_model_open_with_from_pretrained(tmp_path: Path, tok, kind) -> None:
    model = build_model(kind, tok)
    trainer = make_trainer(
        OURS, model, tmp_path / "out", tok, _data(kind, tok), collator_for(kind, tok),
        max_steps=3, save_steps=3,
    )  # fmt: skip
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-3"
    info = CheckpointStore(str(tmp_path / "out")).inspect("checkpoint-3")
    assert info.complete, info.reason
    listed = listed_files(ckpt)
    # every file of the checkpoint went through our writer: fsynced and in the manifest
    on_disk = {p.name for p in ckpt.iterdir()} - {"manifest.json"}
    assert on_disk == listed
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= listed
    if kind != "bert_classifier":
        assert "generation_config.json" in listed
    _assert_opens_as_trained(ckpt, kind, trainer.model, tok)

    final = tmp_path / "final"
    trainer.save_model(str(final))
    _assert_opens_as_trained(final, kind, trainer.model, tok)


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_names_match_transformers(tmp_path: Path, tok, kind) -> None:
    """The same model.safetensors keys (tied duplicates dropped the same way) and the same model
    files as transformers.Trainer's checkpoint."""
    dirs = {}
    for side in (OURS, THEIRS):
        trainer = make_trainer(
            side, build_model(kind, tok), tmp_path / side, tok, _data(kind, tok),
            collator_for(kind, tok), max_steps=1, save_steps=1,
        )  # fmt: skip
        trainer.train()
        dirs[side] = tmp_path / side / "checkpoint-1"
    ours, theirs = dirs[OURS], dirs[THEIRS]
    assert safetensors_names(ours / "model.safetensors") == safetensors_names(
        theirs / "model.safetensors"
    )
    model_side = {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    theirs_files = {p.name for p in theirs.iterdir()} & model_side
    assert theirs_files <= {p.name for p in ours.iterdir()}
    if kind != "bert_classifier":
        # tied input/output embeddings: the duplicate is not stored
        assert "lm_head.weight" not in safetensors_names(ours / "model.safetensors")


def test_resume_of_a_tied_model_continues_exactly(tmp_path: Path, tok) -> None:
    """Llama with tied embeddings: the checkpoint drops the tied duplicate as transformers does,
    and our resume still continues bit for bit."""
    full = make_trainer(
        OURS, build_model("llama", tok), tmp_path / "full", tok, causal_data(tok),
        collator_for("llama", tok),
    )  # fmt: skip
    full.train()
    resumed_model = build_model("llama", tok)
    with torch.no_grad():  # other starting weights: the checkpoint must overwrite them
        for p in resumed_model.parameters():
            p.add_(1.0)
    resumed = make_trainer(
        OURS, resumed_model, tmp_path / "run", tok, causal_data(tok), collator_for("llama", tok)
    )
    # checkpoint-3 of the uninterrupted run: the run as if it had stopped there
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    assert resumed_model.lm_head.weight is resumed_model.model.embed_tokens.weight
    want = losses(full)
    assert losses(resumed, since=3) == {s: want[s] for s in (4, 5, 6)}
    assert_same_state(resumed_model.state_dict(), full.model.state_dict())


def test_a_cold_resume_continues_as_transformers_own_does(
    tmp_path: Path, tok, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same script under both Trainers, each resumed from its own checkpoint-3 with the
    page cache dropped (a resume on a new node): ours reads the optimizer file with O_DIRECT
    (issue 38.5) and both continue with the same losses."""
    from trainer_runtime.checkpoint import io as checkpoint_io
    from trainer_runtime.checkpoint.direct_read import open_direct
    from trainer_runtime.checkpoint.model_state import OPTIMIZER_NAME

    opened: list[tuple[str, bool]] = []

    def spy(path: str, size: int) -> int | None:
        fd = open_direct(path, size)
        opened.append((os.path.basename(path), fd is not None))
        return fd

    monkeypatch.setattr(checkpoint_io, "open_direct", spy)
    resumed: dict[str, dict[int, float]] = {}
    for side in (THEIRS, OURS):
        data, collate = causal_data(tok), collator_for("gpt2", tok)
        make_trainer(side, build_model("gpt2", tok), tmp_path / side, tok, data, collate).train()
        checkpoint = tmp_path / side / "checkpoint-3"
        drop_from_page_cache(checkpoint)
        again = make_trainer(side, build_model("gpt2", tok), tmp_path / f"{side}-resumed", tok,
                             data, collate)  # fmt: skip
        again.train(resume_from_checkpoint=str(checkpoint))
        resumed[side] = losses(again, since=3)
    assert opened == [(OPTIMIZER_NAME, True)], opened  # ours only, and cold: direct
    assert sorted(resumed[OURS]) == sorted(resumed[THEIRS]) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[OURS][step] == pytest.approx(resumed[THEIRS][step], rel=1e-6), step
