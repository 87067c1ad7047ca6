"""The same scripts trained with transformers.Trainer and with ours: equal logs, metrics, weights.

Each script is written once against ``api`` (see side_by_side.py); only the Trainer,
TrainingArguments and TrainerCallback classes differ between the two runs. Models are the tiny
real models of models.py (dropout off, same seed), data is read in order
(``train_sampling_strategy="sequential"``), everything runs on CPU in float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.transformers import models
from tests.transformers import side_by_side as sbs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


_load_weights = sbs.load_weights
assert_runs_match = sbs.assert_runs_match


# -- (a) causal LM ---------------------------------------------------------------------------------
def causal_lm_script(
    builder: str, *, use_cache: bool = False, train_size: int = 24, **overrides: Any
) -> sbs.Script:
    def script(api: sbs.Api, out: Path) -> dict[str, Any]:
        from transformers import DataCollatorForLanguageModeling

        tok = models.tokenizer()
        model = getattr(models, builder)(tok, seed=0)
        model.config.use_cache = use_cache
        train = models.causal_lm_dataset(tok, n=train_size, seed=0).remove_columns(["text"])
        held_out = models.causal_lm_dataset(tok, n=8, seed=1).remove_columns(["text"])
        options: dict[str, Any] = {
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 4,
            "max_steps": 5,  # not a multiple of eval_steps: the last step is evaluated too
            "logging_steps": 1,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_strategy": "steps",
            "save_steps": 5,
            "learning_rate": 1e-3,
            "warmup_steps": 2,
            "max_grad_norm": 1.0,
            **overrides,
        }
        trainer = api.Trainer(
            model=model,
            args=api.args(out, **options),
            train_dataset=train,
            eval_dataset=held_out,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=sbs.callbacks(api),
        )
        output = trainer.train()
        trainer.save_model(str(out / "final"))
        return {
            "trainer": trainer,
            "train": output,
            "eval": trainer.evaluate(),
            "predict": trainer.predict(held_out),
        }

    return script


@pytest.mark.parametrize("builder", ["gpt2", "llama"])
def test_causal_lm_side_by_side(builder: str, tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(causal_lm_script(builder), tmp_path)
    assert len(theirs.train_logs()) == 5  # logging_steps=1
    assert [e["step"] for e in theirs.eval_logs()][:3] == [2, 4, 5]
    assert_runs_match(theirs, ours)
    # train() result: same step, loss and metric keys (summary includes total_flos)
    t_out, o_out = theirs.results["train"], ours.results["train"]
    assert o_out.global_step == t_out.global_step
    assert o_out.training_loss == pytest.approx(t_out.training_loss, rel=sbs.REL_TOL)
    # transformers' PrinterCallback (disable_tqdm=True) pops total_flos out of the very dict
    # train() returns; ours leaves it there (docs/trainer.md, differences). log_history has it.
    assert "total_flos" in ours.summary() and "total_flos" in theirs.summary()
    sbs.assert_metrics_match(
        t_out.metrics, {k: v for k, v in o_out.metrics.items() if k != "total_flos"}, "train()"
    )
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")
    t_pred, o_pred = theirs.results["predict"], ours.results["predict"]
    sbs.assert_metrics_match(t_pred.metrics, o_pred.metrics, "predict().metrics")
    sbs.assert_arrays_match(t_pred.predictions, o_pred.predictions, "predictions")
    sbs.assert_arrays_match(t_pred.label_ids, o_pred.label_ids, "label_ids")
    # the final weights, as save_model() wrote them
    sbs.assert_state_dicts_match(
        _load_weights(theirs.output_dir / "final"),
        _load_weights(ours.output_dir / "final"),
        "save_model() weights",
    )
    # the TrainerControl saved in the checkpoint (written after the step's log and evaluation:
    # should_log and should_evaluate are false, should_save true, in both)
    controls = [
        json.loads((run.output_dir / "checkpoint-5" / "trainer_state.json").read_text())[
            "stateful_callbacks"
        ]["TrainerControl"]
        for run in (theirs, ours)
    ]
    assert controls[0] == controls[1], controls


def test_causal_lm_with_cache_side_by_side(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(causal_lm_script("gpt2", use_cache=True), tmp_path)
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")
    sbs.assert_arrays_match(
        theirs.results["predict"].predictions, ours.results["predict"].predictions, "predictions"
    )


def test_causal_lm_epochs_with_accumulation(tmp_path: Path) -> None:
    """Two epochs of 5 micro-batches with gradient_accumulation_steps=2 (the last step of an
    epoch has one micro-batch): fractional epochs, per-epoch evaluation and saves, the
    summary's train_loss over uneven steps."""
    script = causal_lm_script(
        "gpt2",
        max_steps=-1,
        num_train_epochs=2,
        gradient_accumulation_steps=2,
        eval_strategy="epoch",
        save_strategy="epoch",
        eval_steps=None,
        save_steps=500,
        train_size=20,
    )
    theirs, ours = sbs.run_both(script, tmp_path)
    assert theirs.count("on_epoch_end") == 2
    assert_runs_match(theirs, ours)


def test_callback_stop_calls_on_epoch_end(tmp_path: Path) -> None:
    """A callback that stops training mid-epoch: on_epoch_end still runs (and with it the epoch
    strategy's evaluation and save), then the summary, as transformers does."""

    def script(api: sbs.Api, out: Path) -> dict[str, Any]:
        from transformers import DataCollatorForLanguageModeling

        class StopAt3(api.TrainerCallback):  # type: ignore[misc, name-defined]
            def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
                if state.global_step == 3:
                    control.should_training_stop = True
                return control

        tok = models.tokenizer()
        model = models.gpt2(tok, seed=0)
        model.config.use_cache = False
        train = models.causal_lm_dataset(tok, n=32, seed=0).remove_columns(["text"])
        held_out = models.causal_lm_dataset(tok, n=8, seed=1).remove_columns(["text"])
        trainer = api.Trainer(
            model=model,
            args=api.args(
                out,
                per_device_train_batch_size=4,
                per_device_eval_batch_size=4,
                num_train_epochs=2,
                logging_steps=2,
                eval_strategy="epoch",
                save_strategy="epoch",
            ),
            train_dataset=train,
            eval_dataset=held_out,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=[*sbs.callbacks(api), StopAt3()],
        )
        return {"trainer": trainer, "train": trainer.train()}

    theirs, ours = sbs.run_both(script, tmp_path)
    assert ("on_epoch_end", 3) in theirs.events
    assert_runs_match(theirs, ours)
    assert (ours.output_dir / "checkpoint-3").is_dir()


# -- (b) classification ----------------------------------------------------------------------------
def accuracy(eval_pred: Any) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


def classification_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    from transformers import DataCollatorWithPadding

    tok = models.tokenizer()
    model = models.bert_classifier(tok, seed=0)
    train = models.classification_dataset(tok, n=32, seed=0).remove_columns(["text"])
    held_out = models.classification_dataset(tok, n=16, seed=1).remove_columns(["text"])
    trainer = api.Trainer(
        model=model,
        args=api.args(
            out,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=8,
            max_steps=8,
            learning_rate=5e-3,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="steps",
            save_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="accuracy",
        ),
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=accuracy,
        callbacks=sbs.callbacks(api),
    )
    output = trainer.train()
    trainer.save_model(str(out / "final"))
    return {
        "trainer": trainer,
        "train": output,
        "eval": trainer.evaluate(),
        "predict": trainer.predict(held_out),
    }


def test_classification_side_by_side(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(classification_script, tmp_path)
    assert all("eval_accuracy" in e for e in theirs.eval_logs())
    assert_runs_match(theirs, ours)
    t_state, o_state = theirs.trainer.state, ours.trainer.state
    assert o_state.best_metric == pytest.approx(t_state.best_metric)
    assert o_state.best_global_step == t_state.best_global_step
    assert Path(o_state.best_model_checkpoint).name == Path(t_state.best_model_checkpoint).name
    # evaluate() after training runs on the best model on both sides
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")
    t_pred, o_pred = theirs.results["predict"], ours.results["predict"]
    sbs.assert_metrics_match(t_pred.metrics, o_pred.metrics, "predict().metrics")
    sbs.assert_arrays_match(t_pred.predictions, o_pred.predictions, "predictions")
    sbs.assert_arrays_match(t_pred.label_ids, o_pred.label_ids, "label_ids")
    sbs.assert_state_dicts_match(
        _load_weights(theirs.output_dir / "final"),
        _load_weights(ours.output_dir / "final"),
        "save_model() weights (the best model)",
    )


def test_from_pretrained_of_our_checkpoint_and_save_model(tmp_path: Path) -> None:
    from transformers import BertForSequenceClassification

    theirs, ours = sbs.run_both(classification_script, tmp_path)
    best = Path(theirs.trainer.state.best_model_checkpoint).name
    reference = BertForSequenceClassification.from_pretrained(theirs.output_dir / "final")
    for directory in (ours.output_dir / best, ours.output_dir / "final"):
        assert (directory / "config.json").is_file(), f"{directory} has no config.json"
        loaded = BertForSequenceClassification.from_pretrained(directory)
        sbs.assert_state_dicts_match(reference.state_dict(), loaded.state_dict(), str(directory))


# -- (c) seq2seq with the plain Trainer -----------------------------------------------------------
def seq2seq_script(*, ignore_keys: list[str] | None) -> sbs.Script:
    """T5 with the plain Trainer. Evaluations during training compute the loss only
    (prediction_loss_only); evaluate()/predict() afterwards return predictions, dropping
    ``ignore_keys`` from the model outputs."""

    def script(api: sbs.Api, out: Path) -> dict[str, Any]:
        from transformers import DataCollatorForSeq2Seq

        tok = models.tokenizer()
        model = models.t5(tok, seed=0)
        train = models.seq2seq_dataset(tok, n=24, seed=0)
        held_out = models.seq2seq_dataset(tok, n=8, seed=1)
        trainer = api.Trainer(
            model=model,
            args=api.args(
                out,
                per_device_train_batch_size=4,
                per_device_eval_batch_size=4,
                max_steps=5,
                learning_rate=1e-3,
                logging_steps=1,
                eval_strategy="steps",
                eval_steps=2,
                save_strategy="no",
                prediction_loss_only=True,
            ),
            train_dataset=train,
            eval_dataset=held_out,
            data_collator=DataCollatorForSeq2Seq(tok, model=model),
            callbacks=sbs.callbacks(api),
        )
        output = trainer.train()
        trainer.save_model(str(out / "final"))
        trainer.args.prediction_loss_only = False
        return {
            "trainer": trainer,
            "train": output,
            "eval": trainer.evaluate(ignore_keys=ignore_keys),
            "predict": trainer.predict(held_out, ignore_keys=ignore_keys),
        }

    return script


def test_seq2seq_side_by_side(tmp_path: Path) -> None:
    # the decoder's cache is an output both sides must be told to drop
    theirs, ours = sbs.run_both(seq2seq_script(ignore_keys=["cache"]), tmp_path)
    assert [e["step"] for e in theirs.eval_logs()][:3] == [2, 4, 5]
    assert_runs_match(theirs, ours)
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")
    t_pred, o_pred = theirs.results["predict"], ours.results["predict"]
    sbs.assert_metrics_match(t_pred.metrics, o_pred.metrics, "predict().metrics")
    sbs.assert_arrays_match(t_pred.predictions, o_pred.predictions, "predictions")
    sbs.assert_arrays_match(t_pred.label_ids, o_pred.label_ids, "label_ids")
    sbs.assert_state_dicts_match(
        _load_weights(theirs.output_dir / "final"),
        _load_weights(ours.output_dir / "final"),
        "save_model() weights",
    )


def test_seq2seq_predict_drops_cache_side_by_side(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(seq2seq_script(ignore_keys=None), tmp_path)
    sbs.assert_arrays_match(
        theirs.results["predict"].predictions, ours.results["predict"].predictions, "predictions"
    )


def compute_loss_override_script(builder: str) -> sbs.Script:
    """A Trainer subclass overriding compute_loss, as user code does, reading the count."""

    def script(api: sbs.Api, out: Path) -> dict[str, Any]:
        from transformers import DataCollatorForLanguageModeling

        seen: list[tuple[str, float | None]] = []

        class Recording(api.Trainer):  # type: ignore[misc, name-defined]
            def compute_loss(  # type: ignore[no-untyped-def]
                self, model, inputs, return_outputs=False, num_items_in_batch=None
            ):
                if num_items_in_batch is None:
                    seen.append(("None", None))
                else:  # user code calls .item() / .to(device) on it
                    value = num_items_in_batch.to(model.device).item()
                    seen.append((type(num_items_in_batch).__name__, float(value)))
                return super().compute_loss(
                    model,
                    inputs,
                    return_outputs=return_outputs,
                    num_items_in_batch=num_items_in_batch,
                )

        tok = models.tokenizer()
        model = getattr(models, builder)(tok, seed=0)
        train = models.causal_lm_dataset(tok, n=16, seed=0).remove_columns(["text"])
        trainer = Recording(
            model=model,
            args=api.args(
                out,
                per_device_train_batch_size=2,
                gradient_accumulation_steps=2,
                max_steps=3,
                logging_steps=1,
                save_strategy="no",
            ),
            train_dataset=train,
            data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
            callbacks=sbs.callbacks(api),
        )
        trainer.train()
        return {"trainer": trainer, "seen": seen}

    return script


def test_compute_loss_override_gets_num_items_as_transformers_passes_it(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(compute_loss_override_script("gpt2"), tmp_path)
    assert theirs.results["seen"] and theirs.results["seen"][0][0] == "Tensor"
    assert ours.results["seen"] == theirs.results["seen"]
    assert_runs_match(theirs, ours)


def dropout_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    """Dropout on: every step's loss depends on the global torch RNG stream, which must be the
    same under both Trainers from the first step on (transformers' DataLoader draws its base
    seed from it when an epoch's iterator starts)."""
    from transformers import DataCollatorForLanguageModeling

    tok = models.tokenizer()
    model = models.gpt2(tok, seed=0, dropout=0.2)
    train = models.causal_lm_dataset(tok, n=12, seed=0).remove_columns(["text"])
    trainer = api.Trainer(
        model=model,
        args=api.args(
            out,
            per_device_train_batch_size=4,
            num_train_epochs=2,  # a second epoch: its iterator draws again
            logging_steps=1,
            save_strategy="no",
        ),
        train_dataset=train,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=sbs.callbacks(api),
    )
    trainer.train()
    return {"trainer": trainer}


def test_dropout_masks_match_from_the_first_step(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(dropout_script, tmp_path)
    assert len(theirs.train_logs()) == 6
    assert_runs_match(theirs, ours)


def iterable_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    """A streamed dataset (an IterableDataset without a length) shorter than max_steps: epochs
    are fractional, counted in max_steps * gradient_accumulation_steps micro-batches."""
    from transformers import DataCollatorForLanguageModeling

    tok = models.tokenizer()
    model = models.gpt2(tok, seed=0)
    rows = list(models.causal_lm_dataset(tok, n=20, seed=0).remove_columns(["text"]))

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(rows)

    trainer = api.Trainer(
        model=model,
        args=api.args(
            out,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=7,  # 5 steps per pass: a second pass begins
            logging_steps=1,
            save_strategy="no",
        ),
        train_dataset=Stream(),
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=sbs.callbacks(api),
    )
    trainer.train()
    return {"trainer": trainer}


def test_iterable_dataset_logs_fractional_epochs(tmp_path: Path) -> None:
    theirs, ours = sbs.run_both(iterable_script, tmp_path)
    epochs = [e["epoch"] for e in theirs.train_logs()]
    assert epochs[0] == pytest.approx(1 / 7) and epochs[-1] > 1.0, epochs
    assert [e["epoch"] for e in ours.train_logs()] == pytest.approx(epochs)
    assert_runs_match(theirs, ours)


def eval_num_items_script(api: sbs.Api, out: Path) -> dict[str, Any]:
    """A compute_loss override recording what it gets in training and in evaluation (during
    train() and from evaluate()): type, dtype and value of ``num_items_in_batch``."""
    from transformers import DataCollatorForLanguageModeling

    seen: list[tuple[str, str, str | None, float | None]] = []

    class Recording(api.Trainer):  # type: ignore[misc, name-defined]
        def compute_loss(  # type: ignore[no-untyped-def]
            self, model, inputs, return_outputs=False, num_items_in_batch=None
        ):
            phase = "train" if model.training else "eval"
            if num_items_in_batch is None:
                seen.append((phase, "None", None, None))
            else:
                dtype = getattr(num_items_in_batch, "dtype", None)
                seen.append(
                    (
                        phase,
                        type(num_items_in_batch).__name__,
                        None if dtype is None else str(dtype),
                        float(num_items_in_batch),
                    )
                )
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )

    tok = models.tokenizer()
    model = models.gpt2(tok, seed=0)
    train = models.causal_lm_dataset(tok, n=16, seed=0).remove_columns(["text"])
    held_out = models.causal_lm_dataset(tok, n=6, seed=1).remove_columns(["text"])
    trainer = Recording(
        model=model,
        args=api.args(
            out,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=4,  # a short last batch: 4 + 2
            gradient_accumulation_steps=2,
            max_steps=3,
            logging_steps=1,
            eval_strategy="steps",
            eval_steps=2,
            save_strategy="no",
        ),
        train_dataset=train,
        eval_dataset=held_out,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=sbs.callbacks(api),
    )
    trainer.train()
    return {"trainer": trainer, "seen": seen, "eval": trainer.evaluate()}


def test_compute_loss_override_gets_num_items_in_evaluation_as_transformers_passes_it(
    tmp_path: Path,
) -> None:
    theirs, ours = sbs.run_both(eval_num_items_script, tmp_path)
    evals = [s for s in theirs.results["seen"] if s[0] == "eval"]
    assert evals and all(s[1] == "Tensor" for s in evals), theirs.results["seen"]
    assert ours.results["seen"] == theirs.results["seen"]
    assert_runs_match(theirs, ours)
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")


def group_by_length_script(gradient_accumulation_steps: int) -> sbs.Script:
    """``train_sampling_strategy="group_by_length"`` with the same seed under both Trainers, two
    epochs, dropout on, then evaluate() and predict(): the padded length of every batch is
    recorded (by the collator)."""

    def script(api: sbs.Api, out: Path) -> dict[str, Any]:
        from transformers import DataCollatorForLanguageModeling

        tok = models.tokenizer()
        model = models.gpt2(tok, seed=0, dropout=0.1)
        # 64 samples of 5 to 13 tokens: megabatches of 4 batches, sorted within
        train = models.causal_lm_dataset(tok, n=64, seed=0).remove_columns(["text"])
        collate = DataCollatorForLanguageModeling(tok, mlm=False)
        padded: list[int] = []

        def recording_collator(features: list[dict[str, Any]]) -> Any:
            batch = collate(features)
            padded.append(int(batch["input_ids"].shape[1]))
            return batch

        trainer = api.Trainer(
            model=model,
            args=api.args(
                out,
                train_sampling_strategy="group_by_length",
                per_device_train_batch_size=4,
                per_device_eval_batch_size=2,  # megabatches of 5 batches
                gradient_accumulation_steps=gradient_accumulation_steps,
                num_train_epochs=2,
                logging_steps=1,
                save_strategy="no",
            ),
            train_dataset=train,
            data_collator=recording_collator,
            callbacks=sbs.callbacks(api),
        )
        trainer.train()
        trained = len(padded)
        # transformers length-groups the evaluation and prediction batches too (seeded)
        held_out = models.causal_lm_dataset(tok, n=40, seed=1).remove_columns(["text"])
        metrics = trainer.evaluate(held_out)
        predicted = trainer.predict(held_out)
        return {
            "trainer": trainer,
            "padded": padded[:trained],
            "eval_padded": padded[trained:],
            "eval": metrics,
            "predict": predicted,
        }

    return script


@pytest.mark.parametrize("gradient_accumulation_steps", [1, 2])
def test_group_by_length_batch_order_equals_transformers(
    gradient_accumulation_steps: int, tmp_path: Path
) -> None:
    theirs, ours = sbs.run_both(group_by_length_script(gradient_accumulation_steps), tmp_path)
    assert len(theirs.results["padded"]) == 32  # 16 micro-batches per epoch, two epochs
    assert len(set(theirs.results["padded"])) > 1  # lengths vary: the order is visible
    assert ours.results["padded"] == theirs.results["padded"]
    assert_runs_match(theirs, ours)
    assert len(set(theirs.results["eval_padded"])) > 1
    assert ours.results["eval_padded"] == theirs.results["eval_padded"]
    sbs.assert_metrics_match(theirs.results["eval"], ours.results["eval"], "evaluate()")
    t_pred, o_pred = theirs.results["predict"], ours.results["predict"]
    sbs.assert_metrics_match(t_pred.metrics, o_pred.metrics, "predict().metrics")
    sbs.assert_arrays_match(t_pred.label_ids, o_pred.label_ids, "label_ids")
