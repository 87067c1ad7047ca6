"""``model_init``, ``hyperparameter_search`` (optuna) and ``push_to_hub`` to an fsspec target.

model_init and the hyperparameter search run side by side with transformers' Trainer (same
script, only the classes differ): same losses, same trial objectives, same BestRun. push_to_hub
has no Hub to compare with: the pushed directory must open with ``from_pretrained``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest.importorskip("transformers", reason="needs transformers (dev extra)")

from tests.transformers import models
from tests.transformers import side_by_side as sbs
from trainer_runtime.errors import ConfigurationError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# -- shared pieces ---------------------------------------------------------------------------------
def unseeded_gpt2(tok: Any) -> Any:
    """A tiny GPT-2 whose weights depend on the global RNG: the Trainer's seed decides them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def lm_data(tok: Any, n: int, seed: int) -> Any:
    return models.causal_lm_dataset(tok, n=n, seed=seed).remove_columns(["text"])


def collator(tok: Any) -> Any:
    from transformers import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(tok, mlm=False)


def lm_trainer(which: str, out: Path, *, args: dict[str, Any] | None = None, **kw: Any) -> Any:
    tok = kw.pop("tok", None) or models.tokenizer()
    options = {"train_sampling_strategy": "sequential", **(args or {})}
    kw.setdefault("train_dataset", lm_data(tok, 16, 0))
    kw.setdefault("data_collator", collator(tok))
    return sbs.make_trainer(which, out, args=options, **kw)


# -- model_init ------------------------------------------------------------------------------------
def test_model_init_trains_like_transformers(tmp_path: Path) -> None:
    tok = models.tokenizer()
    calls: dict[str, int] = {}

    def run(which: str) -> list[float]:
        calls[which] = 0

        def model_init() -> Any:
            calls[which] += 1
            return unseeded_gpt2(tok)

        trainer = lm_trainer(which, tmp_path, tok=tok, model_init=model_init, args={"seed": 7})
        first = trainer.model
        torch.manual_seed(1234)  # train() must re-seed before it rebuilds the model
        losses = sbs.train_losses(trainer)
        assert trainer.model is not first, f"{which}: train() did not rebuild the model"
        # A second train() starts again from a fresh, identically seeded model.
        trainer.state.log_history.clear()
        again = sbs.train_losses(trainer)
        assert again == pytest.approx(losses, rel=1e-6)
        return losses

    result = sbs.both(run)
    assert result["ours"] == pytest.approx(result["transformers"], rel=1e-5)
    assert calls["ours"] == calls["transformers"] == 3  # __init__ and each train()


def test_model_init_takes_the_trial(tmp_path: Path) -> None:
    from trainer_runtime.trainer import Trainer

    seen: list[Any] = []

    def model_init(trial: Any) -> Any:
        seen.append(trial)
        return unseeded_gpt2(models.tokenizer())

    trainer = lm_trainer("ours", tmp_path, model_init=model_init)
    assert isinstance(trainer, Trainer)
    assert seen == [None]
    marker = {"lr": 1.0}
    assert isinstance(trainer.call_model_init(marker), torch.nn.Module)
    assert seen[-1] is marker


@pytest.mark.parametrize("which", sbs.IMPLEMENTATIONS)
def test_model_and_model_init_together_are_refused(which: str, tmp_path: Path) -> None:
    tok = models.tokenizer()
    with pytest.raises(ValueError, match="model_init"):
        lm_trainer(which, tmp_path, model=unseeded_gpt2(tok), model_init=lambda: None)


def test_model_init_errors(tmp_path: Path) -> None:
    tok = models.tokenizer()
    model = unseeded_gpt2(tok)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError, match="create_optimizer_and_scheduler"):
        lm_trainer(
            "ours", tmp_path, model_init=lambda: unseeded_gpt2(tok), optimizers=(optimizer, None)
        )
    with pytest.raises(ConfigurationError, match="none or one"):
        lm_trainer("ours", tmp_path, model_init=lambda a, b: model)
    with pytest.raises(ConfigurationError, match="returned None"):
        lm_trainer("ours", tmp_path, model_init=lambda: None)


# -- hyperparameter_search -------------------------------------------------------------------------
HPO_ARGS = {"max_steps": 2, "save_strategy": "steps", "save_steps": 2, "logging_steps": 1}


def hp_space(trial: Any) -> dict[str, Any]:
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
        "gradient_accumulation_steps": trial.suggest_categorical(
            "gradient_accumulation_steps", [1, 2]
        ),
    }


def hpo_trainer(which: str, out: Path, tok: Any, **args: Any) -> Any:
    return lm_trainer(
        which,
        out,
        tok=tok,
        model_init=lambda: unseeded_gpt2(tok),
        eval_dataset=lm_data(tok, 8, 1),
        args={**HPO_ARGS, **args},
    )


def test_hyperparameter_search_matches_transformers_and_plain_runs(tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tok = models.tokenizer()
    trials: dict[str, list[tuple[dict[str, Any], float]]] = {}

    def run(which: str) -> Any:
        trials[which] = []
        trainer = hpo_trainer(which, tmp_path / "hpo", tok)

        def objective(metrics: dict[str, float]) -> float:
            value = float(metrics["eval_loss"])
            trials[which].append((dict(trainer._trial.params), value))
            return value

        best = trainer.hyperparameter_search(
            hp_space=hp_space,
            compute_objective=objective,
            n_trials=2,
            direction="minimize",
            backend="optuna",
            sampler=optuna.samplers.RandomSampler(seed=0),
        )
        return best, trainer

    result = sbs.both(run)
    theirs, ours = result["transformers"][0], result["ours"][0]
    # BestRun: same type shape, same best trial, same objective and hyperparameters.
    assert type(ours).__name__ == type(theirs).__name__ == "BestRun"
    assert ours._fields == theirs._fields
    assert ours.run_id == theirs.run_id and isinstance(ours.run_id, str)
    assert ours.objective == pytest.approx(theirs.objective, rel=1e-5)
    assert ours.hyperparameters == pytest.approx(theirs.hyperparameters)
    assert len(trials["ours"]) == len(trials["transformers"]) == 2
    for (p_ours, v_ours), (p_theirs, v_theirs) in zip(
        trials["ours"], trials["transformers"], strict=True
    ):
        assert p_ours == pytest.approx(p_theirs)
        assert v_ours == pytest.approx(v_theirs, rel=1e-5)
    # Each trial's checkpoints are under output_dir/run-<n>; output_dir is restored afterwards.
    ours_trainer = result["ours"][1]
    root = tmp_path / "hpo" / "ours"
    assert str(ours_trainer.args.output_dir) == str(root)
    for n in range(2):
        assert (root / f"run-{n}" / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (root / "checkpoint-2").exists()
    # A plain run with a trial's hyperparameters gives that trial's objective.
    params, value = trials["ours"][1]
    plain = hpo_trainer("ours", tmp_path / "plain", tok, **params)
    plain.train()
    assert plain.evaluate()["eval_loss"] == pytest.approx(value, rel=1e-6)


def test_hyperparameter_search_objective_from_evaluation_during_training(tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tok = models.tokenizer()

    def run(which: str) -> Any:
        trainer = hpo_trainer(which, tmp_path, tok, eval_strategy="steps", eval_steps=1)
        best = trainer.hyperparameter_search(
            hp_space=hp_space, n_trials=2, sampler=optuna.samplers.RandomSampler(seed=1)
        )
        evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
        return best, evals

    result = sbs.both(run)
    (theirs, _), (ours, evals) = result["transformers"], result["ours"]
    assert ours.run_id == theirs.run_id
    assert ours.objective == pytest.approx(theirs.objective, rel=1e-5)
    assert len(evals) == HPO_ARGS["max_steps"]  # reported during training, no extra evaluate()


def test_hyperparameter_search_prunes_like_transformers(tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    tok = models.tokenizer()

    class PruneFirstTrial(optuna.pruners.BasePruner):
        def prune(self, study: Any, trial: Any) -> bool:
            return trial.number == 0

    def run(which: str) -> Any:
        out = tmp_path / which
        trainer = hpo_trainer(which, out, tok, eval_strategy="steps", eval_steps=1)
        best = trainer.hyperparameter_search(
            hp_space=hp_space,
            n_trials=2,
            sampler=optuna.samplers.RandomSampler(seed=2),
            pruner=PruneFirstTrial(),
        )
        return best

    result = sbs.both(run)
    theirs, ours = result["transformers"], result["ours"]
    assert ours.run_id == theirs.run_id == "1"
    assert ours.objective == pytest.approx(theirs.objective, rel=1e-5)
    root = tmp_path / "ours" / "ours"
    # Trial 0 stopped at its first evaluation (step 1), before its save at step 2.
    assert not (root / "run-0" / "checkpoint-2").exists()
    assert (root / "run-1" / "checkpoint-2" / "manifest.json").is_file()


def test_hyperparameter_search_without_optuna_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = hpo_trainer("ours", tmp_path, models.tokenizer())
    monkeypatch.setitem(sys.modules, "optuna", None)  # "import optuna" now raises ImportError
    for backend in (None, "optuna"):
        with pytest.raises(ConfigurationError, match=r"optuna package.*pip install optuna"):
            trainer.hyperparameter_search(hp_space=hp_space, n_trials=1, backend=backend)


@pytest.mark.parametrize("backend", ["ray", "wandb", "sigopt", "nope"])
def test_hyperparameter_search_other_backends_are_refused(backend: str, tmp_path: Path) -> None:
    trainer = hpo_trainer("ours", tmp_path, models.tokenizer())
    with pytest.raises(ConfigurationError, match=rf"backend='{backend}'.*'optuna'"):
        trainer.hyperparameter_search(hp_space=hp_space, n_trials=1, backend=backend)


def test_hyperparameter_search_needs_model_init(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    tok = models.tokenizer()
    trainer = lm_trainer("ours", tmp_path, tok=tok, model=unseeded_gpt2(tok))
    with pytest.raises(ConfigurationError, match="model_init"):
        trainer.hyperparameter_search(hp_space=hp_space, n_trials=1)


# -- push_to_hub -----------------------------------------------------------------------------------
def hub_trainer(out: Path, target: str | None, **args: Any) -> Any:
    tok = models.tokenizer()
    return lm_trainer(
        "ours",
        out,
        tok=tok,
        model=unseeded_gpt2(tok),
        processing_class=tok,
        args={"hub_model_id": target, **args},
    )


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_push_to_hub_writes_a_loadable_model_and_card(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tmp_path / "pushed"
    trainer = hub_trainer(tmp_path, f"file://{target}", save_strategy="steps", save_steps=3)
    trainer.train()
    assert trainer.push_to_hub(commit_message="done", dataset="tiny corpus") == f"file://{target}"
    loaded = AutoModelForCausalLM.from_pretrained(str(target))
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.cpu()), name
    assert AutoTokenizer.from_pretrained(str(target)).get_vocab() == models.tokenizer().get_vocab()
    card = (target / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "generated_from_trainer" in card and "# pushed" in card and "tiny corpus" in card
    assert "learning_rate: 0.001" in card
    # As transformers' upload: checkpoints stay out; README.md is in output_dir too.
    assert not any(p.name.startswith("checkpoint-") for p in target.iterdir())
    assert (Path(trainer.args.output_dir) / "README.md").is_file()


def test_push_to_hub_memory_target_and_non_blocking(tmp_path: Path) -> None:
    from trainer_runtime.checkpoint.storage import Storage

    trainer = hub_trainer(tmp_path, "memory://hub-test/model")
    future = trainer.push_to_hub(blocking=False)
    assert future.result() == "memory://hub-test/model"
    files = Storage("memory://hub-test/model").walk_files()
    assert {"model.safetensors", "config.json", "README.md", "tokenizer.json"} <= set(files)


def test_save_model_pushes_when_push_to_hub(tmp_path: Path) -> None:
    target = tmp_path / "pushed"
    trainer = hub_trainer(tmp_path, str(target), push_to_hub=True, hub_strategy="end")
    trainer.train()
    assert not (target / "model.safetensors").exists()  # hub_strategy="end": nothing yet
    trainer.save_model()
    assert torch.equal(
        _weights(target)["transformer.wte.weight"], trainer.model.transformer.wte.weight
    )
    assert (target / "README.md").is_file()


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints", "end"])
def test_hub_strategy_pushes_during_training(strategy: str, tmp_path: Path) -> None:
    from trainer_runtime.checkpoint.layout import CheckpointStore, inspect_checkpoint
    from trainer_runtime.checkpoint.storage import Storage

    target = tmp_path / "pushed"
    pushes: list[int] = []
    trainer = hub_trainer(
        tmp_path,
        f"file://{target}",
        push_to_hub=True,
        hub_strategy=strategy,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
    )

    from trainer_runtime.callbacks import TrainerCallback

    class PushRecorder(TrainerCallback):
        def on_push_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            pushes.append(state.global_step)

    trainer.add_callback(PushRecorder())
    trainer.train()
    output = Path(trainer.args.output_dir)
    if strategy == "end":
        assert pushes == [] and list(target.iterdir()) == []
        return
    assert pushes == [2, 4]
    # The model of the last save: what checkpoint-4 holds, loadable from the target.
    assert torch.equal(
        _weights(target)["transformer.wte.weight"],
        _weights(output / "checkpoint-4")["transformer.wte.weight"],
    )
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    assert not (target / "checkpoint-4").exists() or strategy == "all_checkpoints"
    if strategy == "every_save":
        assert not (target / "last-checkpoint").exists()
    if strategy == "checkpoint":
        info = inspect_checkpoint(Storage(str(target / "last-checkpoint")))
        assert info.complete, info.reason
        state = Storage(str(target / "last-checkpoint")).read_json("trainer_state.json")
        assert state["global_step"] == 4
    if strategy == "all_checkpoints":
        store = CheckpointStore(str(target))
        assert [c.step for c in store.list() if c.complete] == [2, 4]
    # The pushed checkpoint resumes like the original one.
    if strategy == "checkpoint":
        resumed = hub_trainer(tmp_path / "again", None, max_steps=4)
        resumed.train(resume_from_checkpoint=str(target / "last-checkpoint"))
        assert resumed.state.global_step == 4


@pytest.mark.parametrize("hub_model_id", ["user/model", "model", None])
def test_hub_repo_id_is_refused_with_a_clear_message(
    hub_model_id: str | None, tmp_path: Path
) -> None:
    with pytest.raises(ConfigurationError, match=r"no Hugging Face Hub is reachable.*fsspec"):
        hub_trainer(tmp_path, hub_model_id, push_to_hub=True)
    trainer = hub_trainer(tmp_path, hub_model_id)  # push_to_hub=False: accepted until a push
    with pytest.raises(ConfigurationError, match="no Hugging Face Hub is reachable"):
        trainer.push_to_hub()


def test_push_revision_is_refused(tmp_path: Path) -> None:
    trainer = hub_trainer(tmp_path, f"file://{tmp_path}/pushed")
    with pytest.raises(ConfigurationError, match=r"revision='dev'.*no branches"):
        trainer.push_to_hub(revision="dev")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.args.hub_revision = "dev"
    with pytest.raises(ConfigurationError, match="no branches"):
        trainer.push_to_hub()
