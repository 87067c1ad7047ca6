"""``push_to_hub`` without a Hub: the push target is an fsspec URL given as ``hub_model_id``.

No Hugging Face Hub is reachable from the machines this runtime trains on, so ``hub_model_id``
names a directory on any fsspec filesystem instead (``file:///models/run1``, ``s3://bucket/run1``,
``memory://run1``; an absolute local path works too). What transformers uploads, we copy there:

* ``push_to_hub()`` saves the model (``save_model``) and a model card (``README.md``) into
  ``output_dir`` and copies ``output_dir`` to the target, leaving out ``checkpoint-*`` and
  ``_*`` (as transformers' upload does). README.md is written last: once it is there, the push
  is whole.
* With ``args.push_to_hub``, every checkpoint save pushes as ``hub_strategy`` says:
  ``every_save`` the model files, ``checkpoint`` also the checkpoint as ``last-checkpoint/``,
  ``all_checkpoints`` also every checkpoint under its own name, ``end`` nothing during training.
  A copied checkpoint keeps our completeness contract (sentinel first, manifest last). A JIT
  checkpoint (after SIGTERM) is not pushed: the grace period is for the checkpoint only.

A Hub repository id (``user/model``) is refused with a :class:`ConfigurationError`.
:class:`HubMixin` is a base class of :class:`trainer_runtime.trainer.Trainer`.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import json
import logging
import os
from collections.abc import Callable
from importlib import metadata
from typing import Any

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.checkpoint.layout import (
    CHECKPOINT_PREFIX,
    MANIFEST_NAME,
    SENTINEL_NAME,
)
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import ConfigurationError

__all__ = [
    "HubMixin",
    "copy_tree",
    "is_push_target",
    "model_card_text",
    "push_target_problem",
]

logger = logging.getLogger(__name__)

README_NAME = "README.md"
# What transformers' upload leaves out of output_dir (patterns on the path in the folder).
IGNORE_PATTERNS = ("_*", f"{CHECKPOINT_PREFIX}*")
# The files of a checkpoint that hold the model (transformers copies these to output_dir).
MODEL_FILE_NAMES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "pytorch_model.bin",
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_CHUNK = 8 * 1024 * 1024


# -- the target --------------------------------------------------------------------------------
def is_push_target(value: str | None) -> bool:
    """An fsspec URL (``scheme://...``) or an absolute local path: never a Hub repository id."""
    return bool(value) and ("://" in str(value) or str(value).startswith("/"))


def _refusal(hub_model_id: str | None) -> str:
    shown = "not set" if hub_model_id is None else f"{hub_model_id!r}, a Hub repository id"
    return (
        f"hub_model_id is {shown}: no Hugging Face Hub is reachable from this runtime, so "
        "push_to_hub writes to a directory on any fsspec filesystem instead; set hub_model_id "
        "to its URL (e.g. 'file:///models/my-model', 's3://bucket/my-model') or an absolute "
        "path, or set push_to_hub=False"
    )


def push_target_problem(push_to_hub: bool, hub_model_id: str | None) -> str | None:
    """Why these arguments cannot push (for check_runtime_support), None when they can."""
    if not push_to_hub or is_push_target(hub_model_id):
        return None
    return f"push_to_hub=True: {_refusal(hub_model_id)}"


def require_push_target(hub_model_id: str | None) -> str:
    if not is_push_target(hub_model_id):
        raise ConfigurationError(_refusal(hub_model_id))
    assert hub_model_id is not None
    return hub_model_id


def _ignored(rel: str) -> bool:
    return any(fnmatch.fnmatch(rel, pattern) for pattern in IGNORE_PATTERNS)


def _same_place(a: Storage, b: Storage) -> bool:
    return type(a.fs) is type(b.fs) and a.root.rstrip("/") == b.root.rstrip("/")


def _under(inner: Storage, outer: Storage) -> str | None:
    """``inner``'s path relative to ``outer`` when it lies inside it (same filesystem)."""
    if type(inner.fs) is not type(outer.fs):
        return None
    base = outer.root.rstrip("/") + "/"
    return inner.root[len(base) :].strip("/") if inner.root.startswith(base) else None


# -- copying -----------------------------------------------------------------------------------
def copy_file(src: Storage, dst: Storage, rel: str, dst_rel: str | None = None) -> None:
    """Stream one file (flushed and fsynced on local disks, uploaded on object stores)."""
    with src.open_read(rel) as reader, dst.open_write(dst_rel or rel) as writer:
        while chunk := reader.read(_CHUNK):
            writer.write(chunk)


def copy_tree(
    src: Storage,
    dst: Storage,
    *,
    skip: Callable[[str], bool] = lambda rel: False,
    last: tuple[str, ...] = (),
) -> list[str]:
    """Copy every file under ``src`` to ``dst`` (same relative paths) except those ``skip``
    names; the ``last`` ones are copied after all others. Returns the copied paths."""
    if _same_place(src, dst):
        return []
    inside = _under(dst, src)
    files = sorted(
        rel
        for rel in src.walk_files("")
        if not skip(rel) and not (inside and (rel == inside or rel.startswith(inside + "/")))
    )
    ordered = [r for r in files if r not in last] + [r for r in files if r in last]
    dst.makedirs("")
    for rel in ordered:
        copy_file(src, dst, rel)
    return ordered


def copy_checkpoint(src: Storage, dst: Storage) -> None:
    """Copy a complete checkpoint so that a reader of ``dst`` never sees a mix called complete:
    the sentinel goes in first (and the old manifest out), files that the new checkpoint does
    not have are removed, the manifest is copied last, then the sentinel removed."""
    dst.makedirs("")
    dst.write_bytes(SENTINEL_NAME, json.dumps({"pushing": True}).encode())
    if dst.exists(MANIFEST_NAME):
        dst.remove(MANIFEST_NAME)
    files = {rel for rel in src.walk_files("") if rel != SENTINEL_NAME}
    for stale in sorted(set(dst.walk_files("")) - files - {SENTINEL_NAME}):
        dst.remove(stale)
    for rel in sorted(files - {MANIFEST_NAME}):
        copy_file(src, dst, rel)
    if MANIFEST_NAME in files:
        copy_file(src, dst, MANIFEST_NAME)
    dst.remove(SENTINEL_NAME)
    dst.fsync_dir("")


def checkpoint_model_files(checkpoint: Storage) -> list[str]:
    """The files of a checkpoint that hold the model (with the shards its index lists)."""
    present = checkpoint.listdir("")
    names = [n for n in MODEL_FILE_NAMES if n in present]
    for index in INDEX_NAMES:
        if index in present:
            names.append(index)
            weight_map = checkpoint.read_json(index).get("weight_map") or {}
            names.extend(sorted(set(weight_map.values())))
    return names


# -- the model card ----------------------------------------------------------------------------
def _as_list(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _yaml_list(key: str, values: list[str]) -> list[str]:
    return [f"{key}:", *(f"- {json.dumps(v)}" for v in values)] if values else []


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _default_base_model(model: Any) -> str | None:
    """The Hub name the model was loaded from (config._name_or_path), unless a local path."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not name or os.path.isdir(name) or name.startswith(("/", ".")):
        return None
    return str(name)


def _hyperparameters(args: Any) -> list[str]:
    world = max(int(getattr(args, "world_size", 1) or 1), 1)
    accumulation = int(args.gradient_accumulation_steps)
    lines = [
        f"- learning_rate: {args.learning_rate}",
        f"- train_batch_size: {args.per_device_train_batch_size}",
        f"- eval_batch_size: {args.per_device_eval_batch_size}",
        f"- seed: {args.seed}",
    ]
    if world > 1:
        lines.append(f"- num_devices: {world}")
    if accumulation > 1:
        lines.append(f"- gradient_accumulation_steps: {accumulation}")
    if world > 1 or accumulation > 1:
        total = args.per_device_train_batch_size * world * accumulation
        lines.append(f"- total_train_batch_size: {total}")
    lines.append(
        f"- optimizer: {args.optim} (betas=({args.adam_beta1}, {args.adam_beta2}), "
        f"epsilon={args.adam_epsilon}, weight_decay={args.weight_decay})"
    )
    lines.append(f"- lr_scheduler_type: {args.lr_scheduler_type}")
    if args.warmup_steps:
        lines.append(f"- lr_scheduler_warmup_steps: {args.warmup_steps}")
    if args.max_steps and args.max_steps > 0:
        lines.append(f"- training_steps: {args.max_steps}")
    else:
        lines.append(f"- num_epochs: {args.num_train_epochs}")
    return lines


def _results_table(log_history: list[dict[str, Any]]) -> tuple[list[str], dict[str, float]]:
    """A table of the evaluations during training (with the last training loss before each),
    and the last evaluation's metrics."""
    rows: list[dict[str, Any]] = []
    last_train_loss: float | None = None
    for entry in log_history:
        if "loss" in entry:
            last_train_loss = float(entry["loss"])
        if "eval_loss" in entry or any(k.startswith("eval_") for k in entry):
            rows.append({**entry, "_train_loss": last_train_loss})
    if not rows:
        return [], {}
    skip = ("_runtime", "_per_second")
    metric_keys = [
        k for k in rows[-1] if k.startswith("eval_") and not k.endswith(skip) and k != "eval_loss"
    ]
    header = ["Training Loss", "Epoch", "Step", "Validation Loss"]
    header += [k.removeprefix("eval_").replace("_", " ").title() for k in metric_keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(":---:" for _ in header) + "|"]
    for row in rows:
        cells = [
            "No log" if row["_train_loss"] is None else f"{row['_train_loss']:.4f}",
            f"{float(row.get('epoch') or 0):.2f}",
            str(row.get("step", "")),
            f"{row['eval_loss']:.4f}" if "eval_loss" in row else "-",
        ]
        cells += [_cell(row.get(k)) for k in metric_keys]
        lines.append("| " + " | ".join(cells) + " |")
    last = {k: v for k, v in rows[-1].items() if k.startswith("eval_") and not k.endswith(skip)}
    return lines, last


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value if value is not None else "-")


def model_card_text(
    trainer: Any,
    *,
    language: str | None = None,
    license: str | None = None,
    tags: str | list[str] | None = None,
    model_name: str | None = None,
    finetuned_from: str | None = None,
    tasks: str | list[str] | None = None,
    dataset_tags: str | list[str] | None = None,
    dataset: str | list[str] | None = None,
    dataset_args: str | list[str] | None = None,
) -> str:
    """A README.md with Hub-style metadata (front matter) and the training summary."""
    from trainer_runtime.checkpoint.hf_format import is_peft_model, is_pretrained_model

    model = trainer.model
    args = trainer.args
    name = model_name or str(args.output_dir).rstrip("/").rsplit("/", 1)[-1]
    base = finetuned_from or _default_base_model(model)
    all_tags = ["generated_from_trainer", *_as_list(tags)]
    all_tags = list(dict.fromkeys(all_tags))
    library = (
        "peft" if is_peft_model(model) else "transformers" if is_pretrained_model(model) else None
    )
    front = ["---"]
    if library:
        front.append(f"library_name: {library}")
    if license:
        front.append(f"license: {json.dumps(license)}")
    if base:
        front.append(f"base_model: {json.dumps(base)}")
    front += _yaml_list("language", _as_list(language))
    front += _yaml_list("tags", all_tags)
    front += _yaml_list("datasets", _as_list(dataset_tags) or _as_list(dataset))
    front += _yaml_list("pipeline_tags", _as_list(tasks))
    front += ["model-index:", f"- name: {json.dumps(name)}", "  results: []", "---", ""]

    table, last_eval = _results_table(trainer.state.log_history)
    datasets = ", ".join(_as_list(dataset))
    if dataset_args:
        datasets += f" ({', '.join(_as_list(dataset_args))})"
    origin = (
        f"a fine-tuned version of [{base}](https://huggingface.co/{base})"
        if base
        else ("trained from scratch")
    )
    body = [f"# {name}", "", f"This model is {origin}" + (f" on {datasets}." if datasets else ".")]
    if last_eval:
        body += ["It reached these results on the evaluation set:", ""]
        body += [
            f"- {k.removeprefix('eval_').replace('_', ' ').title()}: {_cell(v)}"
            for k, v in last_eval.items()
        ]
    body += ["", "## Training procedure", "", "### Training hyperparameters", ""]
    body += _hyperparameters(args)
    if table:
        body += ["", "### Training results", "", *table]
    body += ["", "### Framework versions", ""]
    for package, label in (
        ("preemptible", "preemptible"),
        ("transformers", "Transformers"),
        ("torch", "PyTorch"),
        ("datasets", "Datasets"),
        ("tokenizers", "Tokenizers"),
        ("peft", "PEFT"),
    ):
        version = _version(package)
        if version:
            body.append(f"- {label} {version}")
    return "\n".join(front + body) + "\n"


# -- the Trainer side --------------------------------------------------------------------------
class HubPushCallback(TrainerCallback):
    """Pushes after every checkpoint save when ``args.push_to_hub`` (transformers does it inside
    its _save_checkpoint)."""

    def __init__(self, trainer: HubMixin) -> None:
        self.trainer = trainer

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        checkpoint = kw.get("checkpoint")
        if args.push_to_hub and checkpoint:
            self.trainer._push_from_checkpoint(str(checkpoint))


class HubMixin:
    # Set by the Trainer; declared for readers and type checkers.
    args: Any
    state: Any
    control: Any
    model: Any
    callback_handler: Any
    processing_class: Any
    sigterm_latch: Any

    hub_model_id: str | None = None
    push_in_progress: Any = None

    def _init_hub(self) -> None:
        """__init__: with args.push_to_hub, check the target and push on every save."""
        self.hub_model_id = None
        self.push_in_progress = None
        if self.args.push_to_hub:
            self.init_hf_repo()
            self.callback_handler.add_callback(HubPushCallback(self))

    def init_hf_repo(self, token: str | None = None, private: bool | None = None) -> None:
        """Check that ``args.hub_model_id`` is a push target (an fsspec URL) and create it.
        ``token`` and ``private`` have no meaning for a directory and are ignored (credentials
        come from the fsspec environment)."""
        if not self.is_world_process_zero():  # type: ignore[attr-defined]
            return
        target = require_push_target(self.args.hub_model_id)
        Storage(target).makedirs("")
        self.hub_model_id = target
        self.push_in_progress = None

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """Write a draft model card, ``README.md``, into ``args.output_dir``."""
        if not self.is_world_process_zero():  # type: ignore[attr-defined]
            return
        text = model_card_text(
            self,
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset_tags=dataset_tags,
            dataset=dataset,
            dataset_args=dataset_args,
        )
        storage = Storage(str(self.args.output_dir))
        storage.makedirs("")
        storage.write_bytes(README_NAME, text.encode("utf-8"))

    def _push_revision(self, revision: str | None) -> None:
        if revision is not None:
            raise ConfigurationError(
                f"revision={revision!r} (or hub_revision): an fsspec push target has no "
                "branches; put the revision into hub_model_id's path instead"
            )

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Save the model and a model card into output_dir and copy output_dir (without
        ``checkpoint-*`` and ``_*``) to ``hub_model_id``, an fsspec URL. ``kwargs`` go to
        :meth:`create_model_card`. Returns the target URL, or with ``blocking=False`` a
        ``concurrent.futures.Future`` of it. ``token`` and ``private`` are ignored."""
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        model_name = kwargs.pop("model_name", None)
        if model_name is None and self.args.should_save:
            where = self.args.hub_model_id or str(self.args.output_dir)
            model_name = str(where).rstrip("/").rsplit("/", 1)[-1]
        self._push_revision(revision if revision is not None else self.args.hub_revision)
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)  # type: ignore[attr-defined]
        if not self.is_world_process_zero():  # type: ignore[attr-defined]
            return None
        model_tags = getattr(self.model, "model_tags", None)
        if model_tags is not None:
            tags = kwargs.get("tags") or []
            tags = [tags] if isinstance(tags, str) else list(tags)
            kwargs["tags"] = tags + [t for t in model_tags if t not in tags]
        self.create_model_card(model_name=model_name, **kwargs)
        self._finish_current_push()
        target = self.hub_model_id
        assert target is not None

        def push() -> str:
            copy_tree(
                Storage(str(self.args.output_dir)),
                Storage(target),
                skip=_ignored,
                last=(README_NAME,),
            )
            logger.info("pushed %s to %s (%s)", self.args.output_dir, target, commit_message)
            return target

        if blocking:
            return push()
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = executor.submit(push)
        executor.shutdown(wait=False)
        self.push_in_progress = future
        return future

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """After a checkpoint save: the model files (and, by hub_strategy, the checkpoint) to
        the target. Runs before training goes on, so no later push is ever skipped."""
        from trainer_runtime.checkpoint.hf_format import processing_files
        from trainer_runtime.checkpoint.model_state import TRAINING_ARGS_NAME

        args = self.args
        if not self.is_world_process_zero() or args.hub_strategy == "end":  # type: ignore[attr-defined]
            return
        latch = self.sigterm_latch
        if latch is not None and latch.triggered:
            logger.warning("not pushing %s: SIGTERM received (JIT checkpoint)", checkpoint_folder)
            return
        if self.hub_model_id is None:
            self.init_hf_repo()
        self._push_revision(args.hub_revision)
        self.callback_handler.on_push_begin(args, self.state, self.control)
        checkpoint = Storage(checkpoint_folder)
        output = Storage(str(args.output_dir))
        output.makedirs("")
        # The model files from the checkpoint: no second gathering of the weights.
        for name in checkpoint_model_files(checkpoint):
            copy_file(checkpoint, output, name)
        for name, data in processing_files(self.processing_class):
            output.write_bytes(name, data)
        output.write_json(TRAINING_ARGS_NAME, args.to_dict())
        output.fsync_dir("")
        target = Storage(str(self.hub_model_id))
        copy_tree(output, target, skip=_ignored, last=(README_NAME,))
        if args.hub_strategy in ("checkpoint", "all_checkpoints"):
            name = (
                "last-checkpoint"
                if args.hub_strategy == "checkpoint"
                else checkpoint_folder.rstrip("/").rsplit("/", 1)[-1]
            )
            copy_checkpoint(checkpoint, Storage(target.join(name)))
        logger.info(
            "pushed step %d to %s (hub_strategy=%s)",
            self.state.global_step,
            self.hub_model_id,
            args.hub_strategy,
        )

    def _finish_current_push(self) -> None:
        """Wait for a push started with blocking=False."""
        future = self.push_in_progress
        if future is not None and not future.done():
            logger.info("waiting for the current push to finish")
            future.result()
