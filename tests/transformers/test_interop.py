"""Checkpoints interoperate both ways, so a team can switch Trainers mid-run.

* transformers.Trainer resumes ours: trainer_state.json loads with its TrainerState, the weights
  and the data position are right (the first loss after resume equals ours), and after
  ``export_transformers_state`` (optimizer.pt, scheduler.pt, rng_state.pth) the whole continued
  run matches ours.
* we resume theirs completely (weights, optimizer.pt, scheduler.pt, rng_state.pth, the data
  position derived from the step): the losses after resume equal those of transformers' own
  resume of the same checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.transformers.ckpt_support import (
    OURS,
    THEIRS,
    build_model,
    causal_data,
    collator_for,
    losses,
    make_trainer,
)
from trainer_runtime.checkpoint.hf_format import export_transformers_state
from trainer_runtime.checkpoint.layout import CheckpointStore

# gradient accumulation and an epoch boundary after the checkpoint: checkpoint-3 sits at
# micro-batch 6 of 8 in epoch 0, so the data position is exercised.
RUN = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}


def _trainer(side: str, tok, out: Path, kind: str = "gpt2"):
    return make_trainer(
        side, build_model(kind, tok), out, tok, causal_data(tok), collator_for(kind, tok), **RUN
    )


@pytest.fixture
def ours_run(tmp_path: Path, tok):
    trainer = _trainer(OURS, tok, tmp_path / "ours")
    trainer.train()
    return trainer, tmp_path / "ours" / "checkpoint-3"


def test_transformers_loads_our_trainer_state(ours_run) -> None:
    from transformers import TrainerState

    _, ckpt = ours_run
    state = TrainerState.load_from_json(str(ckpt / "trainer_state.json"))
    assert state.global_step == 3
    # our own record is a file of its own, listed in the manifest
    record = json.loads((ckpt / "preemptible_state.json").read_text())
    assert record["data_position"]["batch"] == 6


def test_transformers_resumes_ours_weights_and_step(tmp_path: Path, tok, ours_run) -> None:
    ours, ckpt = ours_run
    theirs = _trainer(THEIRS, tok, tmp_path / "theirs")
    theirs.train(resume_from_checkpoint=str(ckpt))
    assert theirs.state.global_step == 6
    # step 4's loss is computed before its optimizer step: right weights, right batches
    assert losses(theirs, since=3)[4] == pytest.approx(losses(ours)[4], rel=1e-6)


@pytest.mark.parametrize("via_cli", [False, True], ids=["python", "cli"])
def test_transformers_resumes_ours_exactly_after_export(
    tmp_path: Path, tok, ours_run, via_cli: bool
) -> None:
    ours, ckpt = ours_run
    if via_cli:
        proc = subprocess.run(
            [sys.executable, "-m", "trainer_runtime.cli", "to-transformers", str(ckpt)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("wrote optimizer.pt, scheduler.pt, rng_state.pth")
    else:
        written = export_transformers_state(str(ckpt))
        assert sorted(written) == ["optimizer.pt", "rng_state.pth", "scheduler.pt"]
    # still complete by our rule (the exported files are not in the manifest)
    assert CheckpointStore(str(ckpt.parent)).inspect(ckpt.name).complete
    theirs = _trainer(THEIRS, tok, tmp_path / "theirs")
    theirs.train(resume_from_checkpoint=str(ckpt))
    want = losses(ours)
    got = losses(theirs, since=3)
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_we_resume_transformers_checkpoint_like_transformers(tmp_path: Path, tok, kind) -> None:
    _trainer(THEIRS, tok, tmp_path / "hf", kind).train()
    ckpt = tmp_path / "hf" / "checkpoint-3"
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= {p.name for p in ckpt.iterdir()}
    their_resume = _trainer(THEIRS, tok, tmp_path / "hf_resumed", kind)
    their_resume.train(resume_from_checkpoint=str(ckpt))
    our_resume = _trainer(OURS, tok, tmp_path / "ours_resumed", kind)
    our_resume.train(resume_from_checkpoint=str(ckpt))
    want, got = losses(their_resume, since=3), losses(our_resume, since=3)
    assert sorted(got) == sorted(want) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-6), step
    assert our_resume.state.global_step == their_resume.state.global_step == 6
    # the optimizer state was restored: a fresh AdamW would have no step count at step 3
    opt_state = our_resume.optimizer.state_dict()["state"]
    assert opt_state and all(int(s["step"]) == 6 for s in opt_state.values())
