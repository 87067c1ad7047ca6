"""The Trainer recipes document, one test per recipe, written the way the document shows them.

Only the import differs (``trainer_runtime`` instead of ``transformers``); each test runs the
recipe on a tiny causal LM and checks the behaviour the document describes.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.unit.features.tiny_lm import PAD, VOCAB, TinyCausalLM
from trainer_runtime import Trainer, TrainerCallback, TrainingArguments
from trainer_runtime.checkpoint.layout import SENTINEL_NAME, CheckpointStore
from trainer_runtime.data.collators import PaddingCollator
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    ENV_TERMINATION_LOG,
)
from trainer_runtime.signals import SigtermLatch

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The operator's variables would redirect output/resume; the recipes run as a plain library.
    for name in (ENV_OUTPUT_DIR, ENV_RESUME_FROM, ENV_ATTEMPT, ENV_TERMINATION_LOG):
        monkeypatch.delenv(name, raising=False)


def fixed_dataset(n: int, seq: int = 6, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Equal-width examples whose real lengths vary (label padding -100), so label counts differ."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 2 + i % (seq - 1)
        ids = torch.full((seq,), PAD, dtype=torch.long)
        ids[:length] = torch.randint(1, VOCAB, (length,), generator=gen)
        labels = torch.full((seq,), -100, dtype=torch.long)
        labels[:length] = ids[:length]
        mask = (labels != -100).long()
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def ragged_dataset(n: int, with_length: bool = False, seed: int = 0) -> list[dict[str, Any]]:
    """Unpadded examples of lengths 2..13 (collated by PaddingCollator)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (n,), generator=gen).tolist()
    out: list[dict[str, Any]] = []
    for length in lengths:
        ids = torch.randint(1, VOCAB, (length,), generator=gen)
        example: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
        if with_length:
            example["length"] = length
        out.append(example)
    return out


def recipe_args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "use_cpu": True,
        "report_to": "none",
        "disable_tqdm": True,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 2,
        "learning_rate": 0.05,
        "seed": 0,
        "save_strategy": "no",
    }
    base.update(kw)
    return TrainingArguments(**base)


class RecordBatches(TinyCausalLM):
    """Records the per-row real lengths of every training micro-batch the model sees."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        if self.training:
            mask = attention_mask if attention_mask is not None else (input_ids != PAD)
            self.seen.append([int(x) for x in mask.sum(dim=1)])
        return super().forward(input_ids, labels, attention_mask, num_items_in_batch)

    def padding(self) -> int:
        return sum(max(b) * len(b) - sum(b) for b in self.seen)


class Events(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.events.append(("step", state.global_step))

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.events.append(("evaluate", state.global_step))


# -- Função de perda personalizada
def test_custom_loss_func_gets_popped_labels_and_accumulated_item_count(tmp_path: Path) -> None:
    calls: list[tuple[torch.Tensor, Any, tuple[int, ...]]] = []

    def my_loss_fn(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        logits = outputs["logits"]
        calls.append((labels.clone(), num_items_in_batch, tuple(logits.shape)))
        # causal LM: position t predicts token t+1
        shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1])
        shift_labels = labels[..., 1:].reshape(-1)
        loss = F.cross_entropy(shift_logits, shift_labels, reduction="sum", ignore_index=-100)
        return loss / num_items_in_batch

    train_dataset = fixed_dataset(8)
    trainer = Trainer(
        model=TinyCausalLM(),
        args=recipe_args(
            tmp_path,
            max_steps=2,
            gradient_accumulation_steps=2,
            train_sampling_strategy="sequential",
        ),
        train_dataset=train_dataset,
        compute_loss_func=my_loss_fn,
    )
    trainer.train()

    assert len(calls) == 4  # 2 steps x 2 micro-batches
    expected = torch.stack([e["labels"] for e in train_dataset])
    received = torch.cat([c[0] for c in calls])
    assert torch.equal(received, expected)  # the labels removed from the batch, in order
    assert all(c[2] == (2, 6, VOCAB) for c in calls)
    for step in range(2):
        pair = calls[2 * step : 2 * step + 2]
        shifted = sum(int((c[0][..., 1:] != -100).sum()) for c in pair)
        unshifted = sum(int((c[0] != -100).sum()) for c in pair)
        assert shifted != unshifted  # the check below can tell the two conventions apart
        assert [int(c[1]) for c in pair] == [shifted, shifted]
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


# -- Avaliando no início
def test_eval_on_start_evaluates_before_the_first_step(tmp_path: Path) -> None:
    def compute_metrics(eval_pred: Any) -> dict[str, float]:
        return {"n": float(len(eval_pred.label_ids))}

    events = Events()
    trainer = Trainer(
        model=TinyCausalLM(),
        args=recipe_args(tmp_path, eval_strategy="epoch", eval_on_start=True, num_train_epochs=1),
        train_dataset=fixed_dataset(4),
        eval_dataset=fixed_dataset(4, seed=1),
        compute_metrics=compute_metrics,
        callbacks=[events],
    )
    trainer.train()

    assert events.events[0] == ("evaluate", 0)
    assert events.events[1] == ("step", 1)
    evals = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in evals] == [0, 2]
    assert evals[0]["eval_n"] == 4.0


def test_eval_on_start_needs_an_eval_strategy() -> None:
    with pytest.raises(ValueError, match="eval_strategy"):
        TrainingArguments(output_dir="out", eval_on_start=True, use_cpu=True)


# -- Avaliações com uso eficiente de memória
def test_eval_accumulation_steps_gives_the_same_predictions(tmp_path: Path) -> None:
    seen: list[tuple[int, ...]] = []

    def compute_metrics(eval_pred: Any) -> dict[str, float]:
        seen.append(tuple(eval_pred.predictions.shape))
        return {"mean_logit": float(eval_pred.predictions.mean())}

    eval_dataset = fixed_dataset(7, seed=2)
    results = []
    for steps in (None, 2):
        trainer = Trainer(
            model=TinyCausalLM(),
            args=recipe_args(tmp_path, eval_strategy="epoch", eval_accumulation_steps=steps),
            eval_dataset=eval_dataset,
            compute_metrics=compute_metrics,
        )
        results.append(trainer.evaluate())
    assert seen == [(7, 6, VOCAB), (7, 6, VOCAB)]  # 4 batches, the last one short
    assert results[0]["eval_mean_logit"] == pytest.approx(results[1]["eval_mean_logit"], abs=1e-6)
    assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], abs=1e-6)


def test_preprocess_logits_for_metrics_runs_per_batch_and_shrinks_predictions(
    tmp_path: Path,
) -> None:
    per_batch: list[tuple[int, ...]] = []

    def preprocess_logits_for_metrics(logits: Any, labels: Any) -> torch.Tensor:
        if isinstance(logits, tuple):
            logits = logits[0]
        per_batch.append(tuple(logits.shape))
        return logits.argmax(dim=-1)

    received: list[Any] = []

    def compute_metrics(eval_preds: Any) -> dict[str, float]:
        preds, labels = eval_preds
        received.append(preds)
        labels = labels[:, 1:].reshape(-1)
        preds = preds[:, :-1].reshape(-1)
        keep = labels != -100  # the 'accuracy' metric of the recipe, without the download
        return {"accuracy": float((preds[keep] == labels[keep]).mean())}

    eval_dataset = fixed_dataset(6, seed=3)
    model = TinyCausalLM()
    trainer = Trainer(
        model=model,
        args=recipe_args(tmp_path, eval_strategy="epoch", eval_accumulation_steps=16),
        eval_dataset=eval_dataset,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )
    metrics = trainer.evaluate()

    assert per_batch == [(2, 6, VOCAB)] * 3  # once per eval batch, on full logits
    (preds,) = received
    assert tuple(preds.shape) == (6, 6)  # token ids, not (6, 6, VOCAB) logits
    with torch.no_grad():
        model.eval()
        ids = torch.stack([e["input_ids"] for e in eval_dataset])
        expected = model(ids)["logits"].argmax(dim=-1)
    assert torch.equal(torch.as_tensor(preds), expected)
    labels = torch.stack([e["labels"] for e in eval_dataset])[:, 1:]
    keep = labels != -100
    accuracy = float((expected[:, :-1][keep] == labels[keep]).float().mean())
    assert metrics["eval_accuracy"] == pytest.approx(accuracy)


# -- Desempenho do Dataloader
def test_dataloader_workers_persistent_and_prefetch(tmp_path: Path) -> None:
    args = recipe_args(
        tmp_path,
        dataloader_num_workers=2,
        dataloader_persistent_workers=True,
        dataloader_prefetch_factor=2,
        dataloader_pin_memory=False,
        num_train_epochs=2,
    )
    trainer = Trainer(model=TinyCausalLM(), args=args, train_dataset=fixed_dataset(4))
    trainer.train()
    assert trainer.state.global_step == 4
    loader = trainer.get_train_dataloader()
    assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 2


@pytest.mark.parametrize(
    "bad",
    [{"dataloader_persistent_workers": True}, {"dataloader_prefetch_factor": 2}],
)
def test_worker_options_require_workers(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="dataloader_num_workers > 0"):
        TrainingArguments(output_dir="out", dataloader_num_workers=0, **bad)


def test_default_dataloader_in_main_process(tmp_path: Path) -> None:
    args = recipe_args(tmp_path, max_steps=2, dataloader_pin_memory=True)
    assert args.dataloader_num_workers == 0
    trainer = Trainer(model=TinyCausalLM(), args=args, train_dataset=fixed_dataset(4))
    trainer.train()
    assert trainer.state.global_step == 2


# -- Agrupar amostras por comprimento
def _padding_for(
    tmp_path: Path, strategy: str, with_length: bool = False, **kw: Any
) -> RecordBatches:
    model = RecordBatches()
    trainer = Trainer(
        model=model,
        args=recipe_args(
            tmp_path / strategy, train_sampling_strategy=strategy, num_train_epochs=1, **kw
        ),
        train_dataset=ragged_dataset(32, with_length=with_length),
        data_collator=PaddingCollator(),
    )
    trainer.train()
    return model


def test_group_by_length_reduces_padding(tmp_path: Path) -> None:
    grouped = _padding_for(tmp_path, "group_by_length", per_device_train_batch_size=4)
    shuffled = _padding_for(tmp_path, "random", per_device_train_batch_size=4)
    assert sorted(x for b in grouped.seen for x in b) == sorted(x for b in shuffled.seen for x in b)
    assert len(grouped.seen) == 8
    assert grouped.padding() < shuffled.padding()


# -- Amostragem de reequilíbrio por lote
def test_batch_rebalance_keeps_samples_per_step_and_balances(tmp_path: Path) -> None:
    model = RecordBatches()
    trainer = Trainer(
        model=model,
        args=recipe_args(
            tmp_path,
            train_sampling_strategy="batch_rebalance",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            length_column_name="length",
            num_train_epochs=1,
        ),
        train_dataset=ragged_dataset(32, with_length=True),
        data_collator=PaddingCollator(),
    )
    trainer.train()
    assert trainer.state.global_step == 4
    assert len(model.seen) == 8
    for step in range(4):
        micro = model.seen[2 * step : 2 * step + 2]
        assert sum(len(b) for b in micro) == 8  # 'per_device_train_batch_size' is an average
    shuffled = _padding_for(tmp_path, "random", per_device_train_batch_size=4)
    assert model.padding() < shuffled.padding()


# -- NEFTune
def test_neftune_trains_then_restores_the_embedding(tmp_path: Path) -> None:
    model = TinyCausalLM()
    hooks_during: list[int] = []

    class Watch(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            hooks_during.append(len(model.embed._forward_hooks))

    trainer = Trainer(
        model=model,
        args=recipe_args(tmp_path, num_train_epochs=3, neftune_noise_alpha=5),
        train_dataset=fixed_dataset(4),
        callbacks=[Watch()],
    )
    ids = torch.stack([e["input_ids"] for e in fixed_dataset(2)])
    model.train()
    clean = model.embed(ids).detach()
    trainer.train()

    assert trainer.state.global_step == 6
    assert hooks_during == [1] * 6  # noise hook active while training
    assert len(model.embed._forward_hooks) == 0  # original embedding restored
    model.train()
    torch.testing.assert_close(model.embed(ids), model.embed(ids))  # no noise any more
    assert not torch.equal(clean, model.embed(ids).detach())  # it did train


# -- Registro
def test_logging_steps_and_first_step(tmp_path: Path) -> None:
    trainer = Trainer(
        model=TinyCausalLM(),
        args=recipe_args(
            tmp_path,
            logging_strategy="steps",
            logging_steps=2,
            logging_first_step=True,
            run_name="model-experiment-v1",
            max_steps=6,
        ),
        train_dataset=fixed_dataset(8),
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == [1, 2, 4, 6]
    assert all(math.isfinite(e["loss"]) and "learning_rate" in e for e in logs)
    assert "train_runtime" in trainer.state.log_history[-1]
    assert trainer.args.run_name == "model-experiment-v1"


def test_logging_strategy_epoch(tmp_path: Path) -> None:
    trainer = Trainer(
        model=TinyCausalLM(),
        args=recipe_args(tmp_path, logging_strategy="epoch", num_train_epochs=2),
        train_dataset=fixed_dataset(6),
    )
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == [3, 6]
    assert [round(e["epoch"]) for e in logs] == [1, 2]


# -- Checkpointing
def _checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))


def test_save_steps_with_total_limit_keeps_the_newest(tmp_path: Path) -> None:
    trainer = Trainer(
        model=TinyCausalLM(),
        args=recipe_args(
            tmp_path, save_strategy="steps", save_steps=2, save_total_limit=2, max_steps=7
        ),
        train_dataset=fixed_dataset(8),
    )
    trainer.train()
    # saves at 2, 4, 6 and (as Hugging Face does) at the end of training, step 7; the newest
    # save_total_limit=2 survive
    assert _checkpoints(tmp_path / "out") == ["checkpoint-6", "checkpoint-7"]


def test_save_strategy_best_keeps_one_checkpoint(tmp_path: Path) -> None:
    def compute_metrics(eval_pred: Any) -> dict[str, float]:
        return {"perplexity": 1.0}  # constant: only the first evaluation is an improvement

    trainer = Trainer(
        model=TinyCausalLM(),
        args=recipe_args(
            tmp_path,
            eval_strategy="epoch",
            save_strategy="best",
            metric_for_best_model="perplexity",
            greater_is_better=False,
            load_best_model_at_end=True,
            num_train_epochs=3,
        ),
        train_dataset=fixed_dataset(4),
        eval_dataset=fixed_dataset(4, seed=5),
        compute_metrics=compute_metrics,
    )
    trainer.train()
    out = tmp_path / "out"
    assert _checkpoints(out) == ["checkpoint-2"]
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-2")


# -- Retomar o treinamento
def _resume_trainer(out: Path, max_steps: int, callbacks: list[Any] | None = None) -> Trainer:
    return Trainer(
        model=TinyCausalLM(),
        args=recipe_args(out, save_strategy="steps", save_steps=2, max_steps=max_steps),
        train_dataset=fixed_dataset(8),
        callbacks=callbacks,
    )


def test_resume_from_newest_complete_checkpoint(tmp_path: Path) -> None:
    full = _resume_trainer(tmp_path / "full", max_steps=6)
    full.train()

    first = _resume_trainer(tmp_path / "run", max_steps=6)
    first.train()
    out = tmp_path / "run" / "out"
    assert _checkpoints(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    # an interrupted save of step 6: the sentinel marks it incomplete
    (out / "checkpoint-6" / SENTINEL_NAME).write_text("")

    events = Events()
    resumed = _resume_trainer(tmp_path / "run", max_steps=6, callbacks=[events])
    resumed.train(resume_from_checkpoint=True)
    assert [s for kind, s in events.events if kind == "step"] == [5, 6]
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)

    explicit = _resume_trainer(tmp_path / "run", max_steps=6, callbacks=[events := Events()])
    explicit.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert [s for kind, s in events.events if kind == "step"] == [3, 4, 5, 6]


# -- Checkpointing JIT
class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SigtermAt(TrainerCallback):
    """Advances the injected clock 1 s per step and 'sends SIGTERM' at the end of one step."""

    def __init__(self, latch: SigtermLatch, clock: FakeClock, step: int) -> None:
        self.latch, self.clock, self.step = latch, clock, step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.clock.now += 1.0
        if state.global_step == self.step and not self.latch.triggered:
            self.latch.trigger()


def test_jit_checkpoint_on_sigterm_then_resume(tmp_path: Path) -> None:
    training_args = recipe_args(
        tmp_path, enable_jit_checkpoint=True, save_strategy="steps", save_steps=100, max_steps=8
    )
    trainer = Trainer(model=TinyCausalLM(), args=training_args, train_dataset=fixed_dataset(8))
    clock = FakeClock()
    trainer.sigterm_latch = SigtermLatch(kill_wait=0, clock=clock)
    trainer.add_callback(SigtermAt(trainer.sigterm_latch, clock, step=3))
    before = signal.getsignal(signal.SIGTERM)
    trainer.train()

    assert signal.getsignal(signal.SIGTERM) is before
    assert trainer.preempted and trainer.control.should_training_stop
    stopped = trainer.state.global_step
    assert stopped == 3  # kill_wait=0: the step in flight was already done, stop right there
    out = tmp_path / "out"
    assert _checkpoints(out) == [f"checkpoint-{stopped}"]
    assert not (out / f"checkpoint-{stopped}" / SENTINEL_NAME).exists()
    info = CheckpointStore(str(out)).latest_complete()
    assert info is not None and info.step == stopped

    events = Events()
    resumed = Trainer(
        model=TinyCausalLM(), args=training_args, train_dataset=fixed_dataset(8), callbacks=[events]
    )
    resumed.train(resume_from_checkpoint=True)
    assert [s for kind, s in events.events if kind == "step"] == list(range(stopped + 1, 9))
