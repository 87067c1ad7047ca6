"""The feature mixin driving real training with the core Trainer.

``WiredTrainer`` / ``WiredArguments`` are the core ``Trainer`` / ``TrainingArguments``, which
inherit the feature classes (docs/features.md, "How it is wired").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.unit.features.tiny_lm import VOCAB, TinyCausalLM, make_batches
from trainer_runtime.checkpoint.io import CheckpointReader
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.checkpoint.model_state import MODEL_NAME
from trainer_runtime.errors import ConfigurationError
from trainer_runtime.features.early_stopping import EarlyStoppingCallback
from trainer_runtime.features.evaluation import EvalPrediction
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

# The core classes carry the features (FeatureArguments and TrainerFeaturesMixin bases).
WiredArguments = TrainingArguments
WiredTrainer = Trainer


def examples(n: int, lengths: list[int], seed: int) -> list[dict[str, torch.Tensor]]:
    batch = make_batches(1, n, lengths=lengths, seed=seed)[0]
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


TRAIN = examples(16, [6, 4, 5, 6], seed=1)
EVAL = examples(6, [6, 3], seed=2)


def args(tmp_path: Path, **kw: Any) -> WiredArguments:
    base: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=0.05,
        max_steps=6,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        optim="adamw_torch",
    )
    base.update(kw)
    return WiredArguments(**base)


def test_eval_every_steps_save_best_and_load_best_at_end(tmp_path: Path):
    a = args(
        tmp_path,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="best",
        load_best_model_at_end=True,
        report_to="tensorboard",
        run_name="g-best",
    )
    assert (a.metric_for_best_model, a.greater_is_better) == ("loss", False)
    trainer = WiredTrainer(model=TinyCausalLM(), args=a, train_dataset=TRAIN, eval_dataset=EVAL)
    trainer.train(resume_from_checkpoint=False)

    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [2, 4, 6]
    losses = [h["eval_loss"] for h in evals]
    best_step = evals[int(np.argmin(losses))]["step"]
    assert trainer.state.best_metric == pytest.approx(min(losses))
    assert trainer.state.best_global_step == best_step
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best_step}")
    # save_strategy='best': checkpoints only at improvements, and only the single best remains
    kept = [c.step for c in CheckpointStore(a.output_dir).list() if c.complete]
    assert kept == [best_step]
    # load_best_model_at_end: the weights are the best checkpoint's
    saved = CheckpointReader(trainer.state.best_model_checkpoint).load_tensors(MODEL_NAME)
    for name, tensor in trainer.model.state_dict().items():
        torch.testing.assert_close(tensor, saved[name])
    state_file = Path(trainer.state.best_model_checkpoint) / "trainer_state.json"
    assert json.loads(state_file.read_text())["best_model_checkpoint"].endswith(
        f"checkpoint-{best_step}"
    )
    # TensorBoard got the training and evaluation scalars
    acc = EventAccumulator(str(tmp_path / "out" / "runs" / "g-best"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/loss")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]


def test_early_stopping_in_training(tmp_path: Path):
    scores = iter([0.5, 0.6, 0.6, 0.55, 0.9, 0.9])

    def fabricated_score(ep: EvalPrediction) -> dict[str, float]:
        return {"score": next(scores)}

    a = args(
        tmp_path,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    trainer = WiredTrainer(
        model=TinyCausalLM(),
        args=a,
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        compute_metrics=fabricated_score,
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    trainer.train(resume_from_checkpoint=False)
    # evals at 2 (0.5 best), 4 (0.6 best), 6 (no), 8 (no: 2 in a row) -> stop at step 8
    assert trainer.state.global_step == 8
    assert trainer.state.best_metric == 0.6 and trainer.state.best_global_step == 4
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-4")
    saved = json.loads((Path(a.output_dir) / "checkpoint-8" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"] == {
        "early_stopping_patience_counter": 2
    }


def test_save_total_limit_keeps_best_and_most_recent(tmp_path: Path):
    scores = iter([0.9, 0.1, 0.2, 0.3, 0.4, 0.5])
    a = args(
        tmp_path,
        max_steps=12,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="accuracy",
    )
    trainer = WiredTrainer(
        model=TinyCausalLM(),
        args=a,
        train_dataset=TRAIN,
        eval_dataset=EVAL,
        compute_metrics=lambda ep: {"accuracy": next(scores)},
    )
    trainer.train(resume_from_checkpoint=False)
    kept = [c.step for c in CheckpointStore(a.output_dir).list() if c.complete]
    assert kept == [2, 12]  # the best (step 2) and the most recent


def test_evaluate_predict_and_metrics_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    def argmax(logits: Any, labels: Any) -> Any:
        return logits.argmax(-1)

    def accuracy(ep: EvalPrediction) -> dict[str, float]:
        preds, labels = ep
        keep = labels[:, 1:] != -100
        return {"accuracy": float((preds[:, :-1][keep] == labels[:, 1:][keep]).mean())}

    a = args(tmp_path, eval_accumulation_steps=1)
    trainer = WiredTrainer(
        model=TinyCausalLM(),
        args=a,
        train_dataset=TRAIN,
        eval_dataset={"a": EVAL[:3], "b": EVAL[3:]},
        compute_metrics=accuracy,
        preprocess_logits_for_metrics=argmax,
    )
    metrics = trainer.evaluate()
    assert {"eval_a_loss", "eval_a_accuracy", "eval_b_loss", "eval_b_accuracy"} <= set(metrics)
    assert "eval_a_runtime" in metrics and "eval_b_samples_per_second" in metrics
    assert [h for h in trainer.state.log_history if "eval_a_loss" in h]

    out = trainer.predict(EVAL)
    assert out.predictions.shape == (6, 6)  # argmax ids, not logits
    assert out.label_ids.shape == (6, 6)
    assert {"test_loss", "test_accuracy", "test_runtime"} <= set(out.metrics)

    capsys.readouterr()
    trainer.log_metrics("test", out.metrics)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "***** test metrics *****"
    assert any(line.strip().startswith("test_loss") for line in lines)
    trainer.save_metrics("test", out.metrics)
    saved = json.loads((Path(a.output_dir) / "test_results.json").read_text())
    assert saved["test_loss"] == pytest.approx(out.metrics["test_loss"])
    assert trainer.metrics_format({"x": 0.123456}) == {"x": 0.1235}


def test_prediction_loss_only_and_label_smoothing(tmp_path: Path):
    a = args(tmp_path, prediction_loss_only=True, label_smoothing_factor=0.1)
    model = TinyCausalLM()
    trainer = WiredTrainer(model=model, args=a, train_dataset=TRAIN, eval_dataset=EVAL)
    out = trainer.predict(EVAL)
    assert out.predictions is None and out.label_ids is None
    # the smoothed loss of the documented targets, per batch of 4, weighted by batch size
    expected, total = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(EVAL), 4):
            chunk = EVAL[start : start + 4]
            batch = {k: torch.stack([e[k] for e in chunk]) for k in chunk[0]}
            logits = model(**batch)["logits"]
            ce = F.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB),
                batch["labels"][:, 1:].reshape(-1),
                label_smoothing=0.1,
            )
            expected += float(ce) * len(chunk)
            total += len(chunk)
    assert out.metrics["test_loss"] == pytest.approx(expected / total, rel=1e-5)


@pytest.mark.parametrize(
    ("kw", "extra", "match"),
    [
        ({"eval_strategy": "steps"}, {"eval_dataset": None}, "needs an eval_dataset"),
        ({"batch_eval_metrics": True}, {"compute_metrics": lambda ep: {}}, "compute_result"),
        ({"fp16": True, "use_cpu": True}, {}, "fp16=True needs a CUDA device"),
    ],
)
def test_setup_errors_are_clear(tmp_path: Path, kw, extra, match):
    params: dict[str, Any] = {"train_dataset": TRAIN, "eval_dataset": EVAL, **extra}
    with pytest.raises(ConfigurationError, match=match):
        WiredTrainer(model=TinyCausalLM(), args=args(tmp_path, **kw), **params)


def test_activation_checkpointing_and_bf16_training(tmp_path: Path):
    a = args(tmp_path, activation_checkpointing=True, bf16=True, use_cpu=True, max_steps=2)
    model = TinyCausalLM()
    trainer = WiredTrainer(model=model, args=a, train_dataset=TRAIN, eval_dataset=EVAL)
    assert model.activation_checkpointing is True
    dtypes: list[torch.dtype] = []
    model.head.register_forward_hook(lambda mod, inp, out: dtypes.append(out.dtype))
    trainer.train(resume_from_checkpoint=False)
    assert trainer.state.global_step == 2
    assert dtypes and set(dtypes) == {torch.bfloat16}  # the forward ran under bf16 autocast
    assert sum(b.calls for b in model.blocks) == 2 * 2 * 2  # 2 steps x 2 blocks x recompute


def test_compile_and_token_counting_hooks(tmp_path: Path):
    a = args(tmp_path, torch_compile_backend="eager", include_num_input_tokens_seen="non_padding")
    model = TinyCausalLM()
    trainer = WiredTrainer(model=model, args=a, train_dataset=TRAIN, eval_dataset=EVAL)
    compiled = trainer._maybe_compile(model)
    assert compiled is not model
    batch = make_batches(1, 2, lengths=[5, 3])[0]
    torch.testing.assert_close(compiled(**batch)["logits"], model(**batch)["logits"])
    trainer._count_tokens([batch, batch])
    assert trainer.state.num_input_tokens_seen == 16  # attention mask: (5 + 3) x 2 micro-batches


def test_eval_on_start_evaluates_before_the_first_step(tmp_path: Path):
    a = args(tmp_path, eval_strategy="epoch", eval_on_start=True, max_steps=2)
    trainer = WiredTrainer(model=TinyCausalLM(), args=a, train_dataset=TRAIN, eval_dataset=EVAL)
    trainer.train(resume_from_checkpoint=False)
    first = trainer.state.log_history[0]
    assert first["step"] == 0 and "eval_loss" in first


@pytest.mark.parametrize("nan_filter", [True, False])
def test_logged_loss_nan_inf_filter(tmp_path: Path, nan_filter: bool):
    calls = {"n": 0}

    def loss_with_a_nan_step(outputs: Any, labels: Any, num_items_in_batch: Any) -> Any:
        calls["n"] += 1
        logits = outputs["logits"][:, :-1].reshape(-1, VOCAB)
        loss = F.cross_entropy(logits, labels[:, 1:].reshape(-1), reduction="sum")
        loss = loss / num_items_in_batch
        # step 2 is NaN, without a gradient path (the weights stay finite)
        return loss * 0.0 + float("nan") if calls["n"] == 2 else loss

    a = args(tmp_path, max_steps=2, logging_nan_inf_filter=nan_filter)
    trainer = WiredTrainer(
        model=TinyCausalLM(), args=a, train_dataset=TRAIN, compute_loss_func=loss_with_a_nan_step
    )
    trainer.train(resume_from_checkpoint=False)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 1
    if nan_filter:
        assert np.isfinite(logged[0])
    else:
        assert np.isnan(logged[0])


def test_num_input_tokens_seen_logged(tmp_path: Path):
    a = args(
        tmp_path,
        max_steps=2,
        include_num_input_tokens_seen="non_padding",
        train_sampling_strategy="sequential",
    )
    trainer = WiredTrainer(model=TinyCausalLM(), args=a, train_dataset=TRAIN)
    trainer.train(resume_from_checkpoint=False)
    mask_per_batch = 6 + 4 + 5 + 6  # lengths cycle over each batch of 4
    assert trainer.state.num_input_tokens_seen == 2 * mask_per_batch
    entry = next(h for h in trainer.state.log_history if "loss" in h)
    assert entry["num_input_tokens_seen"] == 2 * mask_per_batch


def test_log_level_passive_by_default_and_applied_when_set(tmp_path: Path):
    import logging

    runtime = logging.getLogger("trainer_runtime")
    before = runtime.level
    try:
        runtime.setLevel(logging.NOTSET)
        WiredTrainer(model=TinyCausalLM(), args=args(tmp_path), train_dataset=TRAIN)
        assert runtime.level == logging.NOTSET  # "passive": the application's setting stays
        WiredTrainer(
            model=TinyCausalLM(), args=args(tmp_path, log_level="info"), train_dataset=TRAIN
        )
        assert runtime.level == logging.INFO
    finally:
        runtime.setLevel(before)


def test_core_classes_carry_the_features():
    import dataclasses

    from trainer_runtime.features.arguments import FeatureArguments
    from trainer_runtime.features.trainer_features import TrainerFeaturesMixin
    from trainer_runtime.training_args import TrainingArgumentsSchema

    assert issubclass(Trainer, TrainerFeaturesMixin)
    # TrainingArguments is a dataclass generated from the schema, which carries the field group.
    assert issubclass(TrainingArgumentsSchema, FeatureArguments)
    fields = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    assert fields["save_strategy"].default == "steps"
    TrainingArguments(output_dir="out", report_to="tensorboard")  # the core accepts trackers
