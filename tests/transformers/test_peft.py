"""LoRA fine-tuning with peft: checkpoints and save_model() hold the adapter only (as
transformers.Trainer saves it), PeftModel.from_pretrained opens them, resume is exact, and the
bytes written follow the trainable size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.transformers.ckpt_support import (
    OURS,
    THEIRS,
    assert_same_state,
    build_model,
    causal_data,
    collator_for,
    dir_bytes,
    listed_files,
    losses,
    make_trainer,
)

peft = pytest.importorskip("peft")


def _lora(tok):
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
        task_type="CAUSAL_LM", init_lora_weights="gaussian",
    )  # fmt: skip
    torch.manual_seed(1)
    return peft.get_peft_model(build_model("gpt2", tok), config)


def _train(side: str, tok, out: Path, **overrides):
    trainer = make_trainer(
        side, _lora(tok), out, tok, causal_data(tok), collator_for("gpt2", tok), **overrides
    )
    trainer.train()
    return trainer


def _adapter(model) -> dict[str, torch.Tensor]:
    return peft.get_peft_model_state_dict(model)


def test_checkpoint_holds_the_adapter_only_and_opens_with_peft(tmp_path: Path, tok) -> None:
    trainer = _train(OURS, tok, tmp_path / "out", max_steps=3)
    ckpt = tmp_path / "out" / "checkpoint-3"
    listed = listed_files(ckpt)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= listed
    assert "model.safetensors" not in listed and not (ckpt / "model.safetensors").exists()
    # the adapter changed in training: a fresh one would not pass the comparison below
    fresh, trained = _adapter(_lora(tok)), _adapter(trainer.model)
    assert not all(torch.equal(fresh[name], trained[name]) for name in trained)
    for path in (ckpt, Path(trainer.save_model(str(tmp_path / "final")))):
        base = build_model("gpt2", tok)
        loaded = peft.PeftModel.from_pretrained(base, str(path))
        assert_same_state(_adapter(loaded), _adapter(trainer.model))
    assert "model.safetensors" not in {p.name for p in (tmp_path / "final").iterdir()}


def test_same_model_files_as_transformers(tmp_path: Path, tok) -> None:
    """Every model/adapter file transformers.Trainer puts in a PEFT checkpoint is in ours, with
    the same adapter tensor names."""
    from safetensors import safe_open

    dirs = {}
    for side in (OURS, THEIRS):
        _train(side, tok, tmp_path / side, max_steps=1, save_steps=1)
        dirs[side] = tmp_path / side / "checkpoint-1"
    resume_files = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}
    theirs = {p.name for p in dirs[THEIRS].iterdir()} - resume_files - {"trainer_state.json"}
    assert theirs <= {p.name for p in dirs[OURS].iterdir()}
    assert "model.safetensors" not in theirs
    names = []
    for side in (OURS, THEIRS):
        with safe_open(str(dirs[side] / "adapter_model.safetensors"), "pt") as fh:
            names.append(sorted(fh.keys()))
    assert names[0] == names[1]


def test_resume_continues_bit_for_bit(tmp_path: Path, tok) -> None:
    full = _train(OURS, tok, tmp_path / "full")
    resumed = make_trainer(
        OURS, _lora(tok), tmp_path / "run", tok, causal_data(tok), collator_for("gpt2", tok)
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    want = losses(full)
    assert losses(resumed, since=3) == {s: want[s] for s in (4, 5, 6)}
    assert_same_state(_adapter(resumed.model), _adapter(full.model))


def test_bytes_written_follow_the_trainable_size(tmp_path: Path, tok) -> None:
    trainer = _train(OURS, tok, tmp_path / "lora", max_steps=1, save_steps=1)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    assert trainable * 10 < total
    full = make_trainer(
        OURS, build_model("gpt2", tok), tmp_path / "fullft", tok, causal_data(tok),
        collator_for("gpt2", tok), max_steps=1, save_steps=1,
    )  # fmt: skip
    full.train()
    lora_ckpt, full_ckpt = tmp_path / "lora" / "checkpoint-1", tmp_path / "fullft" / "checkpoint-1"
    adapter = (lora_ckpt / "adapter_model.safetensors").stat().st_size
    weights = (full_ckpt / "model.safetensors").stat().st_size
    assert adapter * 5 < weights
    # the whole checkpoint (adapter, its optimizer state, tokenizer, states) stays far below
    # the full fine-tuning checkpoint
    assert dir_bytes(lora_ckpt) * 3 < dir_bytes(full_ckpt)


def test_jit_checkpoint_holds_the_adapter_only(tmp_path: Path, tok, monkeypatch) -> None:
    """A SIGTERM mid-run: the JIT checkpoint is written by the same code, adapter only, and a
    resume from it finishes the run like an uninterrupted one."""
    import os
    import signal

    from trainer_runtime import TrainerCallback
    from trainer_runtime.protocol import ENV_KILL_WAIT_SECONDS

    monkeypatch.setenv(ENV_KILL_WAIT_SECONDS, "0")

    class Preempt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer = make_trainer(
        OURS, _lora(tok), tmp_path / "run", tok, causal_data(tok), collator_for("gpt2", tok),
        enable_jit_checkpoint=True, save_steps=100,
    )  # fmt: skip
    trainer.add_callback(Preempt())
    trainer.train()
    assert trainer.preempted
    ckpt = Path(trainer.last_checkpoint.path)
    listed = listed_files(ckpt)
    assert "adapter_model.safetensors" in listed and "model.safetensors" not in listed
    full = _train(OURS, tok, tmp_path / "full", save_steps=100)
    step = trainer.state.global_step
    resumed = make_trainer(
        OURS, _lora(tok), tmp_path / "run", tok, causal_data(tok), collator_for("gpt2", tok),
        save_steps=100,
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(ckpt))
    want = losses(full)
    assert losses(resumed, since=step) == {s: want[s] for s in range(step + 1, 7)}


def test_resume_side_by_side_with_transformers(tmp_path: Path, tok) -> None:
    """The same LoRA script under both Trainers: 6 steps saving every 3, then a new Trainer
    resumes from the run's mid-epoch checkpoint-3 (4 steps an epoch). The resumed runs log the
    same losses, grad norms, learning rates and epochs, end with the same adapter, and keep
    the same checkpoint directories with transformers' adapter files."""
    from tests.compat.test_scripts import assert_files_match
    from tests.transformers import side_by_side as sbs

    resumed = {}
    for side in (THEIRS, OURS):
        _train(side, tok, tmp_path / side / "first")
        trainer = make_trainer(
            side, _lora(tok), tmp_path / side / "resumed", tok, causal_data(tok),
            collator_for("gpt2", tok),
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=str(tmp_path / side / "first" / "checkpoint-3"))
        resumed[side] = trainer
    theirs, ours = resumed[THEIRS], resumed[OURS]
    assert [e["step"] for e in theirs.state.log_history if "loss" in e] == [1, 2, 3, 4, 5, 6]
    sbs.assert_entries_match(theirs.state.log_history, ours.state.log_history, "log_history")
    sbs.assert_state_dicts_match(_adapter(theirs.model), _adapter(ours.model), "adapter")
    for run in ("first", "resumed"):
        assert_files_match(tmp_path / THEIRS / run, tmp_path / OURS / run)


@pytest.mark.parametrize(
    ("kind", "causal_count", "smoothing_shift"),
    [
        # transformers counts labels[..., 1:] by the loss type (GPT2LMHeadModel has none), but
        # its label smoother shifts for every class its causal-LM auto mapping names
        ("gpt2", False, True),
        ("llama", True, True),
        ("bert_classifier", False, False),
    ],
)
def test_loss_rules_judge_a_peft_model_by_its_base(
    tok, kind: str, causal_count: bool, smoothing_shift: bool
) -> None:
    from trainer_runtime.features.losses import is_causal_lm, label_smoothing_shifts

    targets = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"], "bert_classifier": ["query"]}
    base = build_model(kind, tok)
    wrapped = peft.get_peft_model(
        build_model(kind, tok), peft.LoraConfig(r=2, target_modules=targets[kind])
    )
    for model in (base, wrapped):
        assert is_causal_lm(model) is causal_count, type(model).__name__
        assert label_smoothing_shifts(model) is smoothing_shift, type(model).__name__
