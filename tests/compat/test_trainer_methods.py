"""Trainer methods: transformers' public names and parameters, and every overridable method called
where transformers' Trainer calls it, so that a subclass override (or ``optimizers=``) takes
effect. Each override runs side by side under transformers' Trainer and ours (tiny GPT-2, same
seed, no dropout) and must log equal losses and learning rates."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

transformers = pytest.importorskip("transformers")

from tests.transformers import models  # noqa: E402
from tests.transformers.side_by_side import classes  # noqa: E402
from trainer_runtime import Trainer  # noqa: E402

# Owned by other work items (model_init / hyperparameter search / Hub): not checked here yet.
PENDING = frozenset(
    {"call_model_init", "hyperparameter_search", "push_to_hub", "init_hf_repo", "create_model_card"}
)


def _public_methods(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member) and not isinstance(member, type)
    }


def _parameters(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


# -- (a) names and parameters ----------------------------------------------------------------------


def test_every_public_method_of_transformers_trainer_exists_with_its_parameters() -> None:
    theirs, ours = _public_methods(transformers.Trainer), _public_methods(Trainer)
    missing = sorted(set(theirs) - set(ours) - PENDING)
    assert not missing, f"missing Trainer methods: {missing}"
    differing = {
        name: (_parameters(theirs[name]), _parameters(ours[name]))
        for name in sorted(set(theirs) - PENDING)
        if _parameters(theirs[name]) != _parameters(ours[name])
    }
    assert not differing, f"parameters differ (transformers, ours): {differing}"


def test_static_methods_stay_static() -> None:
    for name in ("get_optimizer_cls_and_kwargs", "metrics_format"):
        assert _parameters(getattr(Trainer, name)) == _parameters(
            getattr(transformers.Trainer, name)
        )
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(
        classes("ours")[1](output_dir="o", optim="sgd", learning_rate=0.1)
    )
    assert cls is torch.optim.SGD and kwargs["lr"] == 0.1


# -- (b) overrides side by side --------------------------------------------------------------------

ARGS: dict[str, Any] = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "max_steps": 4,
    "logging_steps": 1,
    "learning_rate": 5e-3,
    "warmup_steps": 1,
    "weight_decay": 0.1,
    "seed": 0,
    "use_cpu": True,
    "report_to": "none",
    "save_strategy": "no",
    "disable_tqdm": True,
    "train_sampling_strategy": "sequential",
    "dataloader_num_workers": 0,
}


def _setup() -> tuple[Any, Any, Any]:
    tok = models.tokenizer()
    data = models.causal_lm_dataset(tok, n=24).remove_columns("text")
    collator = transformers.DataCollatorForLanguageModeling(tok, mlm=False)
    return tok, data, collator


def _run(
    which: str,
    tmp_path: Path,
    mixin: Callable[[type], type] | None = None,
    *,
    args: dict[str, Any] | None = None,
    trainer_kwargs: Callable[[Any], dict[str, Any]] | None = None,
) -> Any:
    """Train a tiny GPT-2 under ``which`` with the subclass ``mixin(Trainer)``; the trainer."""
    trainer_cls, args_cls = classes(which)
    cls = mixin(trainer_cls) if mixin is not None else trainer_cls
    tok, data, collator = _setup()
    model = models.gpt2(tok)
    extra = trainer_kwargs(model) if trainer_kwargs is not None else {}
    extra.setdefault("train_dataset", data)
    trainer = cls(
        model=model,
        args=args_cls(output_dir=str(tmp_path / which), **{**ARGS, **(args or {})}),
        data_collator=collator,
        processing_class=tok,
        **extra,
    )
    trainer.train()
    return trainer


def _logged(trainer: Any, key: str) -> list[float]:
    return [float(e[key]) for e in trainer.state.log_history if key in e and "loss" in e]


def _side_by_side(tmp_path: Path, mixin: Any = None, **kwargs: Any) -> tuple[Any, Any]:
    theirs = _run("transformers", tmp_path, mixin, **kwargs)
    ours = _run("ours", tmp_path, mixin, **kwargs)
    for key in ("loss", "learning_rate", "grad_norm"):
        a, b = _logged(theirs, key), _logged(ours, key)
        assert len(a) == len(b) == ARGS["max_steps"], (key, a, b)
        assert b == pytest.approx(a, rel=1e-5, abs=1e-7), key
    return theirs, ours


def _sgd_optimizer(base: type) -> type:
    class SgdTrainer(base):  # type: ignore[misc, valid-type]
        def create_optimizer(self, model=None):  # type: ignore[no-untyped-def]
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5)
            return self.optimizer

    return SgdTrainer


def test_create_optimizer_override_is_used(tmp_path: Path) -> None:
    _, ours = _side_by_side(tmp_path, _sgd_optimizer)
    assert isinstance(ours.optimizer, torch.optim.SGD)
    # The schedule starts from the override's lr (0.5), not args.learning_rate.
    assert max(_logged(ours, "learning_rate")) == pytest.approx(0.5)


def _constant_schedule(base: type) -> type:
    class ConstantTrainer(base):  # type: ignore[misc, valid-type]
        def create_scheduler(self, num_training_steps, optimizer=None):  # type: ignore[no-untyped-def]
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, lambda step: 0.25
                )
            return self.lr_scheduler

    return ConstantTrainer


def test_create_scheduler_override_is_used(tmp_path: Path) -> None:
    _, ours = _side_by_side(tmp_path, _constant_schedule)
    assert _logged(ours, "learning_rate") == pytest.approx([ARGS["learning_rate"] * 0.25] * 4)


def _both_overridden(base: type) -> type:
    class Both(base):  # type: ignore[misc, valid-type]
        calls: list[int]

        def create_optimizer_and_scheduler(self, num_training_steps):  # type: ignore[no-untyped-def]
            self.calls = [num_training_steps]
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.2)
            self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 2, gamma=0.5)

    return Both


def test_create_optimizer_and_scheduler_is_not_called_by_train(tmp_path: Path) -> None:
    # transformers' train() calls create_optimizer() and create_scheduler() directly, so this
    # override has no effect there; ours behaves the same (and warns).
    theirs, ours = _side_by_side(tmp_path, _both_overridden)
    assert not hasattr(theirs, "calls") and not hasattr(ours, "calls")
    ours.optimizer = ours.lr_scheduler = None
    ours.create_optimizer_and_scheduler(7)
    assert isinstance(ours.optimizer, torch.optim.SGD) and ours.calls == [7]


def test_optimizers_argument_is_used(tmp_path: Path) -> None:
    def given(model: Any) -> dict[str, Any]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return {"optimizers": (optimizer, schedule)}

    _, ours = _side_by_side(tmp_path, trainer_kwargs=given)
    assert isinstance(ours.optimizer, torch.optim.SGD)


def _no_decay(base: type) -> type:
    class NoDecay(base):  # type: ignore[misc, valid-type]
        def get_decay_parameter_names(self, model):  # type: ignore[no-untyped-def]
            return [n for n, _ in model.named_parameters() if "wte" in n]

    return NoDecay


def test_get_decay_parameter_names_override_is_used(tmp_path: Path) -> None:
    _, ours = _side_by_side(tmp_path, _no_decay, args={"weight_decay": 0.5})
    decayed = [g for g in ours.optimizer.param_groups if g["weight_decay"] == 0.5]
    assert [p.shape for g in decayed for p in g["params"]] == [
        ours.model.transformer.wte.weight.shape
    ]


def _plain_loader(base: type) -> type:
    class PlainLoader(base):  # type: ignore[misc, valid-type]
        def get_train_dataloader(self):  # type: ignore[no-untyped-def]
            return torch.utils.data.DataLoader(
                self.train_dataset, batch_size=4, shuffle=False, collate_fn=self.data_collator
            )

    return PlainLoader


def test_get_train_dataloader_override_returning_a_plain_dataloader(tmp_path: Path) -> None:
    # 24 samples / 4 = 6 batches = 3 steps per epoch: max_steps=4 crosses an epoch.
    _side_by_side(tmp_path, _plain_loader)


def test_plain_dataloader_resumes_by_skipping_batches(tmp_path: Path) -> None:
    args = {"max_steps": 5, "save_strategy": "steps", "save_steps": 2}
    full = _run("ours", tmp_path / "full", _plain_loader, args=args)
    trainer_cls, args_cls = classes("ours")
    tok, data, collator = _setup()
    resumed = _plain_loader(trainer_cls)(
        model=models.gpt2(tok, seed=1),  # different weights: the checkpoint must restore them
        args=args_cls(output_dir=str(tmp_path / "full" / "ours"), **{**ARGS, **args}),
        data_collator=collator,
        train_dataset=data,
        processing_class=tok,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "ours" / "checkpoint-2"))
    assert _logged(resumed, "loss")[2:] == pytest.approx(_logged(full, "loss")[2:], rel=1e-5)


def _extra_loss(base: type) -> type:
    class ExtraLoss(base):  # type: ignore[misc, valid-type]
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
            loss = loss + 0.05 * outputs.logits.float().pow(2).mean()
            return (loss, outputs) if return_outputs else loss

    return ExtraLoss


def test_compute_loss_override_is_used(tmp_path: Path) -> None:
    _, ours = _side_by_side(tmp_path, _extra_loss)
    plain = _run("ours", tmp_path / "plain")
    assert _logged(ours, "loss") != pytest.approx(_logged(plain, "loss"), rel=1e-4)


def _recording_step(base: type) -> type:
    class RecordingStep(base):  # type: ignore[misc, valid-type]
        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[no-untyped-def]
            self.__dict__.setdefault("step_items", []).append(num_items_in_batch)
            return super().training_step(model, inputs, num_items_in_batch)

    return RecordingStep


def test_training_step_override_calling_super(tmp_path: Path) -> None:
    theirs, ours = _side_by_side(tmp_path, _recording_step)
    count = ARGS["max_steps"] * ARGS["gradient_accumulation_steps"]
    assert len(ours.step_items) == len(theirs.step_items) == count
    assert [int(x) for x in ours.step_items] == [int(x) for x in theirs.step_items]


def _recording_log(base: type) -> type:
    class RecordingLog(base):  # type: ignore[misc, valid-type]
        def log(self, logs, start_time=None):  # type: ignore[no-untyped-def]
            kinds = self.__dict__.setdefault("log_calls", [])
            kinds.append(("loss" in logs, "eval_loss" in logs, start_time is not None))
            super().log(logs, start_time)

    return RecordingLog


def test_log_override_receives_start_time(tmp_path: Path) -> None:
    args = {"eval_strategy": "steps", "eval_steps": 2}

    def with_eval(model: Any) -> dict[str, Any]:
        return {"eval_dataset": _setup()[1].select(range(8))}

    theirs, ours = _side_by_side(tmp_path, _recording_log, args=args, trainer_kwargs=with_eval)
    assert ours.log_calls == theirs.log_calls
    assert (True, False, True) in ours.log_calls  # training logs carry the train start time


def _counting_eval(base: type) -> type:
    class CountingEval(base):  # type: ignore[misc, valid-type]
        def _count(self, name: str) -> None:
            counts = self.__dict__.setdefault("counts", {})
            counts[name] = counts.get(name, 0) + 1

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):  # type: ignore[no-untyped-def]
            self._count(f"evaluate:{ignore_keys}")
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

        def get_eval_dataloader(self, eval_dataset=None):  # type: ignore[no-untyped-def]
            self._count("get_eval_dataloader")
            return super().get_eval_dataloader(eval_dataset)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):  # type: ignore[no-untyped-def]
            self._count("prediction_step")
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

        def get_test_dataloader(self, test_dataset):  # type: ignore[no-untyped-def]
            self._count("get_test_dataloader")
            return super().get_test_dataloader(test_dataset)

    return CountingEval


def test_evaluation_overrides_are_called(tmp_path: Path) -> None:
    args = {"eval_strategy": "steps", "eval_steps": 2}

    def with_eval(model: Any) -> dict[str, Any]:
        return {"eval_dataset": _setup()[1].select(range(8))}

    runs = {}
    for which in ("transformers", "ours"):
        trainer_cls, args_cls = classes(which)
        tok, data, collator = _setup()
        trainer = _counting_eval(trainer_cls)(
            model=models.gpt2(tok),
            args=args_cls(output_dir=str(tmp_path / which), **{**ARGS, **args}),
            data_collator=collator,
            train_dataset=data,
            processing_class=tok,
            **with_eval(None),
        )
        trainer.train(ignore_keys_for_eval=["past_key_values"])
        trainer.predict(data.select(range(4)))
        runs[which] = trainer
    assert runs["ours"].counts == runs["transformers"].counts
    assert runs["ours"].counts["evaluate:['past_key_values']"] == 2


def test_compute_loss_context_manager_override_is_entered(tmp_path: Path) -> None:
    import contextlib

    def entering(base: type) -> type:
        class Entering(base):  # type: ignore[misc, valid-type]
            def compute_loss_context_manager(self):  # type: ignore[no-untyped-def]
                self.__dict__["entered"] = self.__dict__.get("entered", 0) + 1
                return contextlib.ExitStack()

        return Entering

    theirs, ours = _side_by_side(tmp_path, entering)
    assert ours.entered == theirs.entered == 8


# -- (c) metric-driven schedules -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"patience": 0, "factor": 0.5}, {"patience": 1, "factor": 0.3, "threshold": 10.0}],
)
def test_reduce_lr_on_plateau_side_by_side(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    args = {
        "max_steps": 6,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "lr_scheduler_type": "reduce_lr_on_plateau",
        "lr_scheduler_kwargs": kwargs,
        "warmup_steps": 0,
    }

    def with_eval(model: Any) -> dict[str, Any]:
        return {"eval_dataset": _setup()[1].select(range(8))}

    runs = {which: _run(which, tmp_path, args=args, trainer_kwargs=with_eval) for which in
            ("transformers", "ours")}  # fmt: skip
    for key in ("loss", "learning_rate"):
        a, b = _logged(runs["transformers"], key), _logged(runs["ours"], key)
        assert len(a) == 6
        assert b == pytest.approx(a, rel=1e-5), key
    rates = _logged(runs["ours"], "learning_rate")
    assert min(rates) < max(rates), "the schedule never reduced the learning rate"
    assert runs["ours"].get_learning_rates() == pytest.approx(
        runs["transformers"].get_learning_rates()
    )


# -- helpers that have no loop role ----------------------------------------------------------------


def test_helpers_match_transformers(tmp_path: Path) -> None:
    runs = {which: _run(which, tmp_path) for which in ("transformers", "ours")}
    theirs, ours = runs["transformers"], runs["ours"]
    assert ours.get_num_trainable_parameters() == theirs.get_num_trainable_parameters()
    assert ours.get_learning_rates() == pytest.approx(theirs.get_learning_rates())
    assert len(ours.get_optimizer_group()) == len(theirs.get_optimizer_group())
    for which, trainer in runs.items():
        assert trainer.get_total_train_batch_size(trainer.args) == 8, which
        assert (trainer.get_tp_size(), trainer.get_cp_size(), trainer.get_sp_size()) == (1, 1, 1)
    loader_ours = ours.get_train_dataloader()
    values_theirs = theirs.set_initial_training_values(theirs.args, theirs.get_train_dataloader())
    assert ours.set_initial_training_values(ours.args, loader_ours) == values_theirs
    assert ours.num_examples(loader_ours) == 24
    assert ours.metrics_format({"train_runtime": 1.5}) == {"train_runtime": "0:00:01.50"}
    ours.save_state()
    theirs.save_state()
    saved = json.loads((tmp_path / "ours" / "trainer_state.json").read_text())
    reference = json.loads((tmp_path / "transformers" / "trainer_state.json").read_text())
    assert saved["global_step"] == reference["global_step"] == 4
    assert set(reference) <= set(saved)


def test_reduce_lr_on_plateau_resumes_exactly(tmp_path: Path) -> None:
    args = {
        "max_steps": 6,
        "gradient_accumulation_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "save_strategy": "steps",
        "save_steps": 3,
        "lr_scheduler_type": "reduce_lr_on_plateau",
        "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5},
        "warmup_steps": 0,
    }

    def with_eval(model: Any) -> dict[str, Any]:
        return {"eval_dataset": _setup()[1].select(range(8))}

    full = _run("ours", tmp_path, args=args, trainer_kwargs=with_eval)
    trainer_cls, args_cls = classes("ours")
    tok, data, collator = _setup()
    resumed = trainer_cls(
        model=models.gpt2(tok, seed=1),
        args=args_cls(output_dir=str(tmp_path / "ours"), **{**ARGS, **args}),
        data_collator=collator,
        train_dataset=data,
        processing_class=tok,
        **with_eval(None),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "ours" / "checkpoint-3"))
    for key in ("loss", "learning_rate"):
        assert _logged(resumed, key)[3:] == pytest.approx(_logged(full, key)[3:], rel=1e-6)
    assert min(_logged(full, "learning_rate")[3:]) < ARGS["learning_rate"]


def test_restore_callback_states_from_checkpoint(tmp_path: Path) -> None:
    """The saved EarlyStoppingCallback counter comes back on resume only when asked, as in
    transformers."""
    from trainer_runtime import EarlyStoppingCallback

    args = {
        "max_steps": 4,
        "gradient_accumulation_steps": 1,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "save_strategy": "steps",
        "save_steps": 2,
        "metric_for_best_model": "loss",
        "greater_is_better": True,  # the eval loss falls: every evaluation counts as no gain
    }

    def make(restore: bool) -> Any:
        trainer_cls, args_cls = classes("ours")
        tok, data, collator = _setup()
        return trainer_cls(
            model=models.gpt2(tok),
            args=args_cls(
                output_dir=str(tmp_path / "ours"),
                restore_callback_states_from_checkpoint=restore,
                **{**ARGS, **args},
            ),
            data_collator=collator,
            train_dataset=data,
            eval_dataset=data.select(range(8)),
            processing_class=tok,
            callbacks=[EarlyStoppingCallback(early_stopping_patience=10)],
        )

    def counter(trainer: Any) -> int:
        (callback,) = [
            cb for cb in trainer.callback_handler.callbacks if type(cb) is EarlyStoppingCallback
        ]
        return int(callback.early_stopping_patience_counter)

    make(False).train()
    checkpoint = str(tmp_path / "ours" / "checkpoint-2")
    state = json.loads((tmp_path / "ours" / "checkpoint-2" / "trainer_state.json").read_text())
    saved = state["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"][
        "early_stopping_patience_counter"
    ]
    assert saved >= 1
    for restore, expected_at_resume in ((True, saved), (False, 0)):
        trainer = make(restore)
        seen: list[int] = []
        trainer.add_callback(_FirstStepProbe(seen, lambda t=trainer: counter(t)))
        trainer.train(resume_from_checkpoint=checkpoint)
        assert seen[0] == expected_at_resume, restore


class _FirstStepProbe:
    """Records ``read()`` at the first step begin of a run (before any new evaluation)."""

    def __init__(self, seen: list[int], read: Callable[[], int]) -> None:
        self.seen, self.read = seen, read

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)

    def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
        if not self.seen:
            self.seen.append(self.read())


def test_get_resumed_dataloader_skips_like_transformers() -> None:
    from torch.utils.data import DataLoader

    def batches(trainer_cls: type) -> list[list[int]]:
        loader = DataLoader(list(range(10)), batch_size=2)
        resumed = trainer_cls.get_resumed_dataloader(None, loader, 2)  # self is unused
        return [b.tolist() for b in resumed]

    assert batches(Trainer) == batches(transformers.Trainer) == [[4, 5], [6, 7], [8, 9]]
