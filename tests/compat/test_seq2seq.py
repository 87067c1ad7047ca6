"""Seq2SeqTrainer / Seq2SeqTrainingArguments against transformers 5.x's, side by side.

Each check runs the same code under transformers' classes and ours (only the two classes differ)
with the tiny T5 of tests/transformers/models.py, on CPU, dropout off, same seed: same eval_loss,
same generated ids (greedy and beam search), same metric keys, same ``predict()`` arrays, with
``generation_max_length``, ``generation_num_beams``, ``generation_config`` and ``**gen_kwargs``.
A short last evaluation batch weighs as a full one in ``eval_loss`` on both sides (transformers'
Seq2SeqTrainer gathers without trimming; the plain Trainer weighs every sample once, on both sides).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from tests.transformers import models  # noqa: E402
from tests.transformers import side_by_side as sbs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

BOTH = ("transformers", "ours")
# evaluate() before any training: transformers times accelerate's model preparation, we have none
# (docs/trainer.md, differences from transformers).
NOT_COMPARED = {"eval_model_preparation_time", "test_model_preparation_time"}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """One intra-op thread: these tiny models run many small kernels, which on a shared machine
    are far faster without thread hand-offs (results do not depend on it: same on both sides)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def classes(which: str) -> tuple[Any, Any]:
    """(Seq2SeqTrainer, Seq2SeqTrainingArguments) of ``which``."""
    if which == "transformers":
        return transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments
    import trainer_runtime

    return trainer_runtime.Seq2SeqTrainer, trainer_runtime.Seq2SeqTrainingArguments


def exact_match(eval_pred: Any) -> dict[str, float]:
    """Generated rows equal to their reference once padding (pad id, -100) is dropped."""
    preds, labels = eval_pred
    if isinstance(preds, tuple):  # logits (predict_with_generate=False): nothing to match
        return {}
    hits = []
    for p, y in zip(preds, labels, strict=True):
        p = [t for t in p.tolist() if t not in (-100, 0, 2)]  # pad, decoder start / bos
        y = [t for t in y.tolist() if t not in (-100, 0, 2)]
        hits.append(p == y)
    return {"exact_match": float(np.mean(hits)), "width": float(np.asarray(preds).shape[1])}


def make(which: str, out: Path, *, train_steps: int = 0, builder: str = "t5", **args: Any) -> Any:
    """A Seq2SeqTrainer of ``which`` on a tiny model of models.py (T5 unless ``builder`` says
    otherwise) with a tokenizer-padded collator."""
    trainer_cls, args_cls = classes(which)
    tok = models.tokenizer()
    model = getattr(models, builder)(tok, seed=0)
    options: dict[str, Any] = {
        **sbs.COMMON_ARGS,
        "output_dir": str(out / which),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "learning_rate": 1e-2,
        "max_steps": max(train_steps, 1),
        "logging_steps": 1,
        "save_strategy": "no",
        **args,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_cls(
            model=model,
            args=args_cls(**options),
            train_dataset=models.seq2seq_dataset(tok, n=16, seed=0),
            eval_dataset=models.seq2seq_dataset(tok, n=8, seed=1),
            processing_class=tok,
            data_collator=transformers.DataCollatorForSeq2Seq(tok, model=model),
            compute_metrics=exact_match,
        )


def held_out(n: int = 8) -> Any:
    return models.seq2seq_dataset(models.tokenizer(), n=n, seed=1)


def assert_metrics_match(theirs: dict[str, Any], ours: dict[str, Any], what: str) -> None:
    drop = NOT_COMPARED
    sbs.assert_metrics_match(
        {k: v for k, v in theirs.items() if k not in drop},
        {k: v for k, v in ours.items() if k not in drop},
        what,
        rel=1e-5,
    )


def assert_predictions_match(theirs: Any, ours: Any, what: str) -> None:
    sbs.assert_arrays_match(theirs.predictions, ours.predictions, f"{what} predictions")
    sbs.assert_arrays_match(theirs.label_ids, ours.label_ids, f"{what} label_ids")
    assert_metrics_match(theirs.metrics, ours.metrics, f"{what} metrics")


# -- one short training run per side, evaluating (with generation) every 2 steps -----------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both trainers after 4 steps with eval_strategy='steps' (eval_steps=2),
    predict_with_generate, generation_max_length=24 (above generate's default 20) and
    generation_num_beams=2; the tests below change the generation arguments and restore them."""
    out = tmp_path_factory.mktemp("trained")
    trainers = {}
    for which in BOTH:
        trainer = make(
            which,
            out,
            train_steps=4,
            predict_with_generate=True,
            generation_max_length=24,
            generation_num_beams=2,
            eval_strategy="steps",
            eval_steps=2,
        )
        trainer.train()
        trainers[which] = trainer
    return trainers


def with_args(trainers: dict[str, Any], **changes: Any) -> Any:
    """Set generation arguments on both trainers; returns a function that restores them."""
    saved = {w: {k: getattr(t.args, k) for k in changes} for w, t in trainers.items()}
    for trainer in trainers.values():
        for key, value in changes.items():
            setattr(trainer.args, key, value)

    def restore() -> None:
        for which, trainer in trainers.items():
            for key, value in saved[which].items():
                setattr(trainer.args, key, value)

    return restore


def test_periodic_evaluation_generates_side_by_side(trained: dict[str, Any]) -> None:
    """eval_strategy='steps' with predict_with_generate: every evaluation during training
    generates with generation_max_length / generation_num_beams (compute_metrics sees generated
    ids: width is the padded generation length, not a logits tensor), and log_history (losses,
    eval_loss, metrics) matches transformers'."""
    runs = {w: [dict(e) for e in t.state.log_history] for w, t in trained.items()}
    evals = [e for e in runs["ours"] if "eval_exact_match" in e]
    assert [e["step"] for e in evals] == [2, 4]
    assert all(e["eval_width"] >= 20 for e in evals)
    sbs.assert_entries_match(runs["transformers"], runs["ours"], "log_history")


@pytest.mark.parametrize("gen_kwargs", [{}, {"num_beams": 2}], ids=["greedy", "beams2"])
def test_evaluate_and_predict_generate_side_by_side(
    trained: dict[str, Any], gen_kwargs: dict[str, Any]
) -> None:
    """evaluate() and predict() with predict_with_generate give the same eval_loss, exact-match
    metric and generated ids as transformers' (greedy and beam search)."""
    restore = with_args(trained, generation_max_length=None, generation_num_beams=None)
    try:
        results = {
            w: (t.evaluate(**gen_kwargs), t.predict(held_out(), **gen_kwargs))
            for w, t in trained.items()
        }
    finally:
        restore()
    (eval_t, pred_t), (eval_o, pred_o) = results["transformers"], results["ours"]
    assert "eval_exact_match" in eval_o and "eval_loss" in eval_o
    assert_metrics_match(eval_t, eval_o, "evaluate()")
    assert_predictions_match(pred_t, pred_o, "predict()")
    # generated ids (not logits): 2-D integer arrays, at least generate's default max_length wide
    assert pred_o.predictions.ndim == 2 and pred_o.predictions.dtype.kind == "i"
    assert pred_o.predictions.shape[0] == 8 and pred_o.predictions.shape[1] >= 20


@pytest.mark.parametrize(
    ("args", "gen_kwargs"),
    [
        ({"generation_max_length": 5}, {}),
        ({"generation_max_length": 5}, {"max_length": 7}),  # the call wins
        ({"generation_max_length": 5}, {"max_new_tokens": 3}),
        ({"generation_max_length": 24, "generation_num_beams": 2}, {}),  # wider than 20
    ],
    ids=["args", "kwarg-wins", "max-new-tokens", "long-beams"],
)
def test_generation_lengths_side_by_side(
    trained: dict[str, Any], args: dict[str, Any], gen_kwargs: dict[str, Any]
) -> None:
    """generation_max_length / generation_num_beams and the call's kwargs resolve as in
    transformers: same generated ids, same padding (pad id inside a batch, -100 across)."""
    restore = with_args(trained, **{"generation_num_beams": None, **args})
    try:
        out = {w: t.predict(held_out(), **gen_kwargs) for w, t in trained.items()}
    finally:
        restore()
    assert_predictions_match(out["transformers"], out["ours"], f"{args} {gen_kwargs}")
    preds = out["ours"].predictions
    cap = gen_kwargs.get("max_length") or args["generation_max_length"]
    if "max_new_tokens" in gen_kwargs:
        cap = gen_kwargs["max_new_tokens"] + 1
    # nothing generated past the cap (the rest is padding up to the model's max_length)
    assert ((preds[:, cap:] == 0) | (preds[:, cap:] == -100)).all()


class StopEveryOtherBatch:
    """A generate() logits processor that makes every other call (batch) end at once with eos,
    so the batches' generated widths differ (2 tokens padded to 20 vs the full 24)."""

    def __init__(self, eos_token_id: int) -> None:
        self.eos = eos_token_id
        self.calls = 0

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if input_ids.shape[1] == 1:  # the first step of a new generate() call
            self.calls += 1
        if self.calls % 2 == 1:
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.eos] = 0.0
            return forced
        return scores


def test_predictions_of_different_widths_are_padded_with_minus_100(
    trained: dict[str, Any],
) -> None:
    """Batches whose generated ids end up of different widths (one stops at once: padded with
    the pad id to the generation config's max_length 20; the next runs to generation_max_length
    24) are joined with -100 padding, exactly as transformers' evaluation loop does."""
    restore = with_args(trained, per_device_eval_batch_size=2, generation_num_beams=None)
    try:
        eos = models.tokenizer().eos_token_id
        out = {
            w: t.predict(held_out(), logits_processor=[StopEveryOtherBatch(eos)])
            for w, t in trained.items()
        }
    finally:
        restore()
    assert_predictions_match(out["transformers"], out["ours"], "mixed widths")
    preds = out["ours"].predictions
    assert preds.shape == (8, 24)
    stopped = (preds[:, 20:] == -100).all(axis=1)
    assert stopped.tolist() == [True, True, False, False] * 2
    assert (preds[stopped, 2:20] == 0).all()  # the pad id inside the stopped batches


@pytest.mark.parametrize("gen_kwargs", [{}, {"num_beams": 2}], ids=["greedy", "beams2"])
def test_bart_side_by_side(tmp_path: Path, gen_kwargs: dict[str, Any]) -> None:
    """The same with a tiny BART (decoder starts with eos, forced eos): train 3 steps, then
    evaluate() and predict() generate the same ids, loss and metrics as transformers'."""
    results = {}
    for which in BOTH:
        trainer = make(which, tmp_path, builder="bart", train_steps=3, predict_with_generate=True)
        trainer.train()
        results[which] = (
            trainer.evaluate(**gen_kwargs),
            trainer.predict(held_out(), **gen_kwargs),
        )
    (eval_t, pred_t), (eval_o, pred_o) = results["transformers"], results["ours"]
    assert "eval_exact_match" in eval_o
    assert_metrics_match(eval_t, eval_o, "BART evaluate()")
    assert_predictions_match(pred_t, pred_o, "BART predict()")
    assert pred_o.predictions.ndim == 2 and pred_o.predictions.dtype.kind == "i"


def test_without_predict_with_generate_it_is_the_trainer(tmp_path: Path) -> None:
    """predict_with_generate=False: logits and the plain Trainer's step, as transformers."""
    out = {w: make(w, tmp_path).predict(held_out()) for w in BOTH}
    sbs.assert_arrays_match(out["transformers"].predictions, out["ours"].predictions, "logits")
    assert_metrics_match(out["transformers"].metrics, out["ours"].metrics, "metrics")
    assert out["ours"].predictions[0].ndim == 3  # (batch, length, vocab) logits


@pytest.mark.parametrize("generate", [False, True], ids=["logits", "generate"])
def test_short_last_batch_weighs_as_a_full_one_side_by_side(tmp_path: Path, generate: bool) -> None:
    """12 samples in batches of 5: transformers' Seq2SeqTrainer counts the batch of 2 as 5 rows
    in eval_loss and test_loss (the mean of the 3 batch losses); so do we."""
    out = {
        w: make(w, tmp_path, per_device_eval_batch_size=5, predict_with_generate=generate)
        for w in BOTH
    }
    metrics = {w: t.evaluate(held_out(12)) for w, t in out.items()}
    assert_metrics_match(metrics["transformers"], metrics["ours"], "evaluate() with a short batch")
    predicted = {w: t.predict(held_out(12)) for w, t in out.items()}
    assert predicted["ours"].label_ids.shape[0] == 12
    assert_metrics_match(
        predicted["transformers"].metrics, predicted["ours"].metrics, "predict() with a short batch"
    )


def test_loss_only_evaluation_side_by_side(tmp_path: Path) -> None:
    """prediction_loss_only: no generation, only the loss (and no compute_metrics)."""
    metrics = {
        w: make(w, tmp_path, predict_with_generate=True, prediction_loss_only=True).evaluate()
        for w in BOTH
    }
    assert "eval_exact_match" not in metrics["ours"]
    assert_metrics_match(metrics["transformers"], metrics["ours"], "loss-only evaluate()")


def test_generation_config_argument_side_by_side(tmp_path: Path) -> None:
    """generation_config (an object, a directory, a JSON file) replaces the model's generation
    config; its max_length caps and pads the generated ids, as transformers."""
    from transformers import GenerationConfig

    tok = models.tokenizer()
    config = GenerationConfig(
        max_length=6,
        num_beams=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.pad_token_id,
    )
    out = {}
    for which in BOTH:
        trainer = make(which, tmp_path, predict_with_generate=True, generation_config=config)
        assert trainer.model.generation_config.max_length == 6
        assert trainer.model.generation_config.num_beams == 2
        assert trainer.model.generation_config is not config  # a copy, as transformers
        out[which] = trainer.predict(held_out())
    assert_predictions_match(out["transformers"], out["ours"], "generation_config object")
    assert out["ours"].predictions.shape[1] == 6
    # the same config from a directory and from its JSON file
    folder = tmp_path / "genconfig"
    config.save_pretrained(folder)
    for value in (str(folder), folder / "generation_config.json"):
        trainer = make("ours", tmp_path, predict_with_generate=True, generation_config=value)
        assert trainer.model.generation_config.max_length == 6
        assert trainer.model.generation_config.num_beams == 2
        np.testing.assert_array_equal(
            trainer.predict(held_out()).predictions, out["ours"].predictions
        )


def test_load_generation_config_rejects_invalid(tmp_path: Path) -> None:
    from transformers import GenerationConfig

    from trainer_runtime import Seq2SeqTrainer
    from trainer_runtime.errors import ConfigurationError

    bad = GenerationConfig()
    bad.num_beams = 1
    bad.early_stopping = True  # a beam-search flag without beam search: invalid when strict
    with pytest.raises(ConfigurationError, match="generation_config"):
        Seq2SeqTrainer.load_generation_config(bad)
    loaded = Seq2SeqTrainer.load_generation_config(GenerationConfig(max_length=9))
    assert loaded.max_length == 9


# -- the arguments --------------------------------------------------------------------------------
def test_arguments_fields_and_defaults_match_transformers() -> None:
    from trainer_runtime.training_args import RUNTIME_ONLY_FIELDS, TrainingArguments

    _, ours = classes("ours")
    theirs = transformers.Seq2SeqTrainingArguments
    names = [f.name for f in dataclasses.fields(ours)]
    # Plus the fields transformers does not have (docs/trainer.md, differences).
    assert set(names) == {f.name for f in dataclasses.fields(theirs)} | set(RUNTIME_ONLY_FIELDS)
    new = ["sortish_sampler", "predict_with_generate", "generation_max_length"]
    new += ["generation_num_beams", "generation_config"]
    assert names[-5:] == new
    defaults = {f.name: f.default for f in dataclasses.fields(theirs)}
    for spec in dataclasses.fields(ours):
        if spec.name in new:
            assert spec.default == defaults[spec.name], spec.name
    assert issubclass(ours, TrainingArguments)


def test_hf_argument_parser_parses_generation_flags(tmp_path: Path) -> None:
    from transformers import HfArgumentParser

    argv = ["--output_dir", str(tmp_path), "--predict_with_generate", "--generation_max_length"]
    argv += ["16", "--generation_num_beams", "3", "--generation_config", str(tmp_path)]
    parsed = {}
    for which in BOTH:
        (args,) = HfArgumentParser((classes(which)[1],)).parse_args_into_dataclasses(argv)
        parsed[which] = args
        assert type(args).__name__ == "Seq2SeqTrainingArguments"
        assert args.predict_with_generate is True
        assert args.generation_max_length == 16
        assert args.generation_num_beams == 3
        assert args.sortish_sampler is False
    assert parsed["ours"].generation_config == parsed["transformers"].generation_config
    (args,) = HfArgumentParser((classes("ours")[1],)).parse_dict(
        {"output_dir": str(tmp_path), "predict_with_generate": True}
    )
    assert args.predict_with_generate and args.generation_max_length is None


def test_to_dict_replace_and_validation(tmp_path: Path) -> None:
    from transformers import GenerationConfig

    from trainer_runtime.errors import ConfigurationError

    _, args_cls = classes("ours")
    args = args_cls(output_dir=str(tmp_path), generation_config=GenerationConfig(max_length=7))
    as_dict = args.to_dict()
    theirs = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), generation_config=GenerationConfig(max_length=7)
    ).to_dict()
    assert as_dict["generation_config"] == theirs["generation_config"]
    assert as_dict["predict_with_generate"] is False
    copy = dataclasses.replace(args, predict_with_generate=True, generation_num_beams=4)
    assert type(copy) is args_cls and copy.generation_num_beams == 4
    with pytest.raises(ConfigurationError, match="generation_num_beams"):
        args_cls(output_dir=str(tmp_path), generation_num_beams=0)
    with pytest.raises(ConfigurationError, match="generation_config"):
        args_cls(output_dir=str(tmp_path), generation_config=3)
    with pytest.raises(ConfigurationError, match="did you mean 'predict_with_generate'"):
        args_cls(output_dir=str(tmp_path), predict_with_generat=True)
    with pytest.raises(ConfigurationError, match="learning_rate"):  # inherited checks still run
        args_cls(output_dir=str(tmp_path), learning_rate=-1.0)
    with pytest.raises(ConfigurationError, match="generation_max_length"):
        args.generation_max_length = -3  # assignments are validated too
    args.generation_max_length = 12
    assert args.generation_max_length == 12
