"""More user-shaped scripts trained with transformers.Trainer and with ours (issue 31).

Each script is written once against ``api`` (see side_by_side.py), only the Trainer API classes
differing: gradient accumulation under a cosine-with-restarts schedule, a run stopped at a
mid-epoch checkpoint and resumed, a dict of evaluation sets, early stopping with the best model,
and prediction with the inputs passed to ``compute_metrics``. (A ``compute_loss`` override and a
streamed dataset are in test_side_by_side.py, LoRA resume in test_peft.py.) Compared: every
log_history entry (losses, grad norms, learning rates, epochs, eval metrics), on_log payloads,
callback events, metrics, predictions, final weights and the checkpoint directories kept.
Evaluation sets are multiples of the eval batch size.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.compat.test_scripts import assert_files_match
from tests.transformers import models
from tests.transformers import side_by_side as sbs
from tests.transformers.test_side_by_side import accuracy, causal_lm_script

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _checkpoints(output_dir: Path) -> list[str]:
    return sorted(
        (p.name for p in output_dir.iterdir() if p.name.startswith("checkpoint-")),
        key=lambda name: int(name.split("-")[1]),
    )


# -- (1) gradient accumulation, cosine with restarts ---------------------------------------------
def test_accumulation_with_cosine_with_restarts(tmp_path: Path) -> None:
    """Two restarts over 8 steps of 2 micro-batches (20 examples: the epoch's last step has one
    micro-batch), one warmup step: every step's learning rate, loss and epoch."""
    script = causal_lm_script(
        "gpt2",
        train_size=20,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2},
        warmup_steps=1,
        max_steps=8,
        eval_steps=4,
        save_steps=8,
    )
    theirs, ours = sbs.run_both(script, tmp_path)
    rates = [e["learning_rate"] for e in theirs.train_logs()]
    # the schedule restarts: after the warmup step, the rate climbs back up after falling
    assert any(b > a for a, b in itertools.pairwise(rates[1:])), rates
    sbs.assert_runs_match(theirs, ours)
    assert_files_match(theirs.output_dir, ours.output_dir)
    sbs.assert_state_dicts_match(
        sbs.load_weights(theirs.output_dir / "final"),
        sbs.load_weights(ours.output_dir / "final"),
        "save_model() weights",
    )


@pytest.mark.parametrize("builder", ["gpt2", "llama"])
def test_label_smoothing_with_accumulation(builder: str, tmp_path: Path) -> None:
    """``label_smoothing_factor``: the smoother shifts the labels of every model transformers
    maps as a causal LM (GPT-2's ``GPT2LMHeadModel`` too), in training and evaluation."""
    script = causal_lm_script(
        builder,
        train_size=16,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        label_smoothing_factor=0.1,
        max_steps=4,
        eval_steps=2,
        save_strategy="no",
    )
    theirs, ours = sbs.run_both(script, tmp_path)
    sbs.assert_runs_match(theirs, ours)
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")


# -- (2) stopped at a mid-epoch checkpoint, resumed -----------------------------------------------
def resume_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    """Train 2 epochs of 5 steps (2 micro-batches each), saving every 3 steps; a callback stops
    the first run at step 3 (micro-batch 6 of 10 of epoch 0), and a new Trainer in the same
    output_dir resumes with ``resume_from_checkpoint=True``."""
    from transformers import DataCollatorForLanguageModeling

    class StopAt3(api.TrainerCallback):  # type: ignore[misc, name-defined]
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            if state.global_step == 3:
                control.should_training_stop = True
            return control

    def build(stop: bool) -> Any:
        tok = models.tokenizer()
        model = models.gpt2(tok, seed=0)
        model.config.use_cache = False
        return api.Trainer(
            model=model,
            args=api.args(
                out,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=2,
                per_device_eval_batch_size=4,
                num_train_epochs=2,
                learning_rate=1e-3,
                warmup_steps=2,
                logging_steps=1,
                eval_strategy="steps",
                eval_steps=3,
                save_steps=3,
            ),
            train_dataset=models.causal_lm_dataset(tok, n=20, seed=0).remove_columns(["text"]),
            eval_dataset=models.causal_lm_dataset(tok, n=8, seed=1).remove_columns(["text"]),
            processing_class=tok,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=[*sbs.callbacks(api), *([StopAt3()] if stop else [])],
        )

    stopped = build(stop=True)
    stopped.train()
    stopped_history = [dict(e) for e in stopped.state.log_history]
    stopped_checkpoints = _checkpoints(out)
    resumed = build(stop=False)
    output = resumed.train(resume_from_checkpoint=True)
    resumed.save_model(str(out / "final"))
    return {
        "trainer": resumed,
        "train": output,
        "stopped_history": stopped_history,
        "stopped_checkpoints": stopped_checkpoints,
        "checkpoints": _checkpoints(out),
    }


def test_mid_epoch_resume(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(resume_script, tmp_path)
    assert theirs.results["stopped_checkpoints"] == ["checkpoint-3"]
    sbs.assert_entries_match(
        theirs.results["stopped_history"], ours.results["stopped_history"], "stopped run"
    )
    # the resumed run's history: the checkpoint's (steps 1-3) and steps 4-10
    assert [e["step"] for e in theirs.train_logs()] == list(range(1, 11))
    assert theirs.events[0] == ("on_train_begin", 3)
    sbs.assert_runs_match(theirs, ours)
    t_out, o_out = theirs.results["train"], ours.results["train"]
    assert o_out.global_step == t_out.global_step == 10
    assert o_out.training_loss == pytest.approx(t_out.training_loss, rel=sbs.REL_TOL)
    assert ours.results["checkpoints"] == theirs.results["checkpoints"]
    assert_files_match(theirs.output_dir, ours.output_dir)
    sbs.assert_state_dicts_match(
        sbs.load_weights(theirs.output_dir / "final"),
        sbs.load_weights(ours.output_dir / "final"),
        "final weights after resume",
    )


# -- (3) a dict of evaluation sets ----------------------------------------------------------------
def eval_dict_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    """``eval_dataset={"a": ..., "b": ...}``: each set evaluated and logged under its own prefix
    (``eval_a_loss``, ``eval_b_accuracy``), the best model chosen by ``a_loss``."""
    from transformers import DataCollatorWithPadding

    tok = models.tokenizer()
    sets = {
        "a": models.classification_dataset(tok, n=8, seed=1).remove_columns(["text"]),
        "b": models.classification_dataset(tok, n=4, seed=2).remove_columns(["text"]),
    }
    trainer = api.Trainer(
        model=models.bert_classifier(tok, seed=0),
        args=api.args(
            out,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            max_steps=6,
            learning_rate=5e-3,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="a_loss",
        ),
        train_dataset=models.classification_dataset(tok, n=24, seed=0).remove_columns(["text"]),
        eval_dataset=sets,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=accuracy,
        callbacks=sbs.callbacks(api),
    )
    trainer.train()
    return {
        "trainer": trainer,
        "eval": trainer.evaluate(),  # every set, one dict
        "eval_b": trainer.evaluate(sets["b"], metric_key_prefix="eval_b"),
    }


def test_dict_of_eval_sets(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(eval_dict_script, tmp_path)
    # during training, then evaluate() (a), then evaluate() (a, b) and evaluate(b) (b)
    assert [e["step"] for e in theirs.eval_logs("eval_a")] == [2, 4, 6, 6]
    assert [e["step"] for e in theirs.eval_logs("eval_b")] == [2, 4, 6, 6, 6]
    assert {"eval_a_loss", "eval_a_accuracy", "eval_b_loss", "eval_b_accuracy"} <= set(
        theirs.results["eval"]
    )
    sbs.assert_runs_match(theirs, ours)
    t_state, o_state = theirs.trainer.state, ours.trainer.state
    assert o_state.best_metric == pytest.approx(t_state.best_metric, rel=sbs.REL_TOL)
    assert o_state.best_global_step == t_state.best_global_step
    for key in ("eval", "eval_b"):
        sbs.assert_metrics_match(theirs.results[key], ours.results[key], f"evaluate() {key}")


# -- (4) early stopping with the best model -------------------------------------------------------
def early_stopping_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    """``EarlyStoppingCallback`` on eval accuracy with ``load_best_model_at_end`` and
    ``save_total_limit=2`` (the best checkpoint is kept besides the newest)."""
    from transformers import DataCollatorWithPadding

    tok = models.tokenizer()
    held_out = models.classification_dataset(tok, n=16, seed=1).remove_columns(["text"])
    trainer = api.Trainer(
        model=models.bert_classifier(tok, seed=0),
        args=api.args(
            out,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=8,
            max_steps=40,
            learning_rate=5e-3,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_steps=2,
            save_total_limit=2,
            load_best_model_at_end=True,
            metric_for_best_model="accuracy",
        ),
        train_dataset=models.classification_dataset(tok, n=32, seed=0).remove_columns(["text"]),
        eval_dataset=held_out,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=accuracy,
        callbacks=[*sbs.callbacks(api), api.EarlyStoppingCallback(early_stopping_patience=2)],
    )
    output = trainer.train()
    trainer.save_model(str(out / "final"))
    return {
        "trainer": trainer,
        "train": output,
        "eval": trainer.evaluate(),
        "checkpoints": _checkpoints(out),
    }


def test_early_stopping_with_best_model(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(early_stopping_script, tmp_path)
    t_state, o_state = theirs.trainer.state, ours.trainer.state
    assert t_state.global_step < 40  # stopped early
    assert t_state.best_global_step < t_state.global_step
    sbs.assert_runs_match(theirs, ours)
    assert o_state.global_step == t_state.global_step
    assert o_state.best_metric == pytest.approx(t_state.best_metric, rel=sbs.REL_TOL)
    assert o_state.best_global_step == t_state.best_global_step
    assert Path(o_state.best_model_checkpoint).name == Path(t_state.best_model_checkpoint).name
    assert ours.results["checkpoints"] == theirs.results["checkpoints"]
    assert_files_match(theirs.output_dir, ours.output_dir)
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")
    sbs.assert_state_dicts_match(
        sbs.load_weights(theirs.output_dir / "final"),
        sbs.load_weights(ours.output_dir / "final"),
        "save_model() weights (the best model)",
    )


# -- (6) prediction with the inputs ---------------------------------------------------------------
def predict_inputs_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    """``include_for_metrics=["inputs", "loss"]``: compute_metrics reads ``eval_pred.inputs``
    (batches of different lengths, padded with -100 when concatenated) and the per-sample
    ``eval_pred.losses``."""
    from transformers import DataCollatorWithPadding

    seen: list[dict[str, Any]] = []

    def metrics_with_inputs(eval_pred: Any) -> dict[str, float]:
        inputs = np.asarray(eval_pred.inputs)
        losses = np.asarray(eval_pred.losses)
        seen.append(
            {
                "inputs": inputs,
                "losses": losses,
                "label_ids": np.asarray(eval_pred.label_ids),
            }
        )
        tokens = (inputs >= 0).sum(axis=-1)  # real tokens (padding of the concatenation: -100)
        correct = np.argmax(eval_pred.predictions, axis=-1) == eval_pred.label_ids
        return {
            "accuracy": float(correct.mean()),
            "tokens_when_correct": float(tokens[correct].mean()) if correct.any() else 0.0,
            "mean_sample_loss": float(losses.mean()),
        }

    tok = models.tokenizer()
    held_out = models.classification_dataset(tok, n=16, seed=1).remove_columns(["text"])
    trainer = api.Trainer(
        model=models.bert_classifier(tok, seed=0),
        args=api.args(
            out,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            max_steps=4,
            learning_rate=5e-3,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="no",
            include_for_metrics=["inputs", "loss"],
        ),
        train_dataset=models.classification_dataset(tok, n=16, seed=0).remove_columns(["text"]),
        eval_dataset=held_out,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=metrics_with_inputs,
        callbacks=sbs.callbacks(api),
    )
    trainer.train()
    test_set = models.classification_dataset(tok, n=12, seed=7).remove_columns(["text"])
    return {"trainer": trainer, "predict": trainer.predict(test_set), "seen": seen}


def test_predict_with_inputs_for_metrics(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(predict_inputs_script, tmp_path)
    assert "eval_tokens_when_correct" in theirs.eval_logs()[0]
    sbs.assert_runs_match(theirs, ours)
    t_pred, o_pred = theirs.results["predict"], ours.results["predict"]
    assert "test_tokens_when_correct" in t_pred.metrics
    sbs.assert_metrics_match(t_pred.metrics, o_pred.metrics, "predict().metrics")
    sbs.assert_arrays_match(t_pred.predictions, o_pred.predictions, "predictions")
    sbs.assert_arrays_match(t_pred.label_ids, o_pred.label_ids, "label_ids")
    # what compute_metrics was given, call by call (2 evaluations, then predict)
    t_seen, o_seen = theirs.results["seen"], ours.results["seen"]
    assert len(t_seen) == len(o_seen) == 3
    assert all((call["inputs"] == -100).any() for call in t_seen)  # batches of unequal lengths
    for i, (a, b) in enumerate(zip(t_seen, o_seen, strict=True)):
        for name in ("inputs", "label_ids", "losses"):
            sbs.assert_arrays_match(a[name], b[name], f"compute_metrics call {i}: {name}")
