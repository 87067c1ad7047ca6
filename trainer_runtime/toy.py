"""A tiny, deterministic training script: what the demo trains and what test pods run.

    python -m trainer_runtime.toy [--max-steps N] [--save-steps K] [--step-sleep SECONDS]
        [--save-total-limit L] [--output-dir URL] [--seed S] [--fail-at-step N] ...

It trains a small MLP with dropout (so the RNG state must survive a resume) on a synthetic
classification set generated from ``--seed`` with :class:`trainer_runtime.Trainer` and
``enable_jit_checkpoint=True`` (``--jit-checkpoint false`` turns it off). It follows the
operator's environment contract: the output dir defaults to $PREEMPTIBLE_OUTPUT_DIR and the
Trainer resumes per $PREEMPTIBLE_RESUME_FROM.

Test hooks: ``--step-sleep`` makes every optimizer step slow (the sleep happens inside the forward
pass, so a signal lands in a step in flight); ``--save-sleep`` routes checkpoints through the
``slowfile://`` filesystem of :mod:`trainer_runtime.testing` so saves are slow;
``--enospc-after-bytes`` routes them through ``fulldiskfile://`` (disk full after N bytes);
``--events-file`` appends one JSON line per event (train_begin, step_begin, step_end, save_begin,
save_committed, save, train_end) so tests wait for real events instead of sleeping;
``--record-samples`` adds a ``samples`` event per training forward pass (the dataset indices of the
micro-batch, its step, and whether it is a padding micro-batch); ``--predict-samples N`` predicts
a labelled set of N samples after training and writes a ``predict`` event.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from trainer_runtime import testing
from trainer_runtime.distributed import collectives
from trainer_runtime.protocol import ENV_OUTPUT_DIR

__all__ = ["ToyDataset", "ToyModel", "build_trainer", "main", "parse_args"]

FEATURES = 16
HIDDEN = 32
CLASSES = 4


class ToyDataset(Dataset):
    """``size`` samples ``{"x": float[16], "labels": int}`` labelled by a random linear teacher.

    A pure function of ``seed``: the same seed gives the same tensors in every process.
    """

    def __init__(self, size: int = 512, seed: int = 0, *, with_index: bool = False) -> None:
        self.with_index = with_index
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, FEATURES, generator=gen)
        teacher = torch.randn(FEATURES, CLASSES, generator=gen)
        noise = 0.5 * torch.randn(size, CLASSES, generator=gen)
        self.labels = (self.x @ teacher + noise).argmax(dim=-1)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = {"x": self.x[index], "labels": self.labels[index]}
        if self.with_index:  # lets a test see which samples a forward pass used
            item["index"] = torch.tensor(index)
        return item


class ToyModel(nn.Module):
    """Linear -> GELU -> Dropout -> Linear; returns ``{"loss", "logits"}`` (HF convention)."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(HIDDEN, CLASSES),
        )

    def forward(
        self,
        x: torch.Tensor,
        labels: torch.Tensor | None = None,
        index: torch.Tensor | None = None,  # dataset indices (--record-samples); unused
    ) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer_runtime.toy",
        description="Train a tiny deterministic MLP with preemption-safe checkpoints.",
    )
    p.add_argument("--max-steps", type=int, default=40, help="optimizer steps in total")
    p.add_argument("--save-steps", type=int, default=10, help="periodic checkpoint every K steps")
    p.add_argument("--save-total-limit", type=int, default=None, help="keep at most L checkpoints")
    p.add_argument(
        "--output-dir",
        default=None,
        help=f"checkpoint root (any fsspec URL); default ${ENV_OUTPUT_DIR}",
    )
    p.add_argument("--seed", type=int, default=42, help="seed of the data, the model and training")
    p.add_argument("--batch-size", type=int, default=8, help="per-device train batch size")
    p.add_argument("--num-samples", type=int, default=512, help="size of the synthetic dataset")
    p.add_argument(
        "--dropout",
        type=float,
        default=0.1,
        help="dropout probability (0: training depends on no RNG, e.g. to compare across sizes)",
    )
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--logging-steps", type=int, default=5)
    p.add_argument(
        "--resume-from",
        default=None,
        help="checkpoint path or 'latest' (default: the Trainer reads $PREEMPTIBLE_RESUME_FROM)",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep in every step")
    p.add_argument(
        "--train-begin-sleep",
        type=float,
        default=0.0,
        help="seconds of sleep after training begins, before the first step",
    )
    p.add_argument(
        "--fail-at-step", type=int, default=None, help="raise a real exception at step N"
    )
    p.add_argument(
        "--fail-rank",
        type=int,
        default=None,
        help="with --fail-at-step: only this rank ($RANK) fails (default: every rank)",
    )
    p.add_argument(
        "--save-sleep",
        type=float,
        default=0.0,
        help="seconds each checkpoint file takes to write (slowfile:// filesystem)",
    )
    p.add_argument(
        "--enospc-after-bytes",
        type=int,
        default=None,
        help="fail checkpoint writes with ENOSPC after N bytes (fulldiskfile:// filesystem)",
    )
    p.add_argument(
        "--ballast-mb",
        type=int,
        default=0,
        help="add a buffer of N MiB to the model (in every checkpoint, unused by training)",
    )
    p.add_argument("--events-file", default=None, help="append one JSON line per event here")
    p.add_argument(
        "--save-on-each-node",
        action="store_true",
        help="every node's main process writes its own copy (save_on_each_node=True)",
    )
    p.add_argument(
        "--accelerator-config",
        default=None,
        help="accelerator_config as a JSON object (dispatch_batches, even_batches, ...)",
    )
    p.add_argument(
        "--record-samples",
        action="store_true",
        help="write a 'samples' event (dataset indices) per training forward pass",
    )
    p.add_argument(
        "--predict-samples",
        type=int,
        default=0,
        help="after training, predict a labelled set of N samples ('predict' event)",
    )
    p.add_argument("--eval-batch-size", type=int, default=8, help="per-device eval batch size")
    p.add_argument(
        "--eval-steps",
        type=int,
        default=0,
        help="evaluate every N steps during training on a set of --eval-samples (0: never)",
    )
    p.add_argument("--eval-samples", type=int, default=64, help="size of the evaluation set")
    p.add_argument(
        "--eval-sleep", type=float, default=0.0, help="seconds of sleep in every eval batch"
    )
    p.add_argument(
        "--stop-policy",
        default=None,
        help="TrainingArguments.jit_stop_policy (finish_step, micro_batch); default: "
        "$PREEMPTIBLE_STOP_POLICY, else finish_step",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--dataloader-num-workers",
        type=int,
        default=0,
        help="TrainingArguments.dataloader_num_workers (DataLoader worker processes)",
    )
    p.add_argument(
        "--dataloader-persistent-workers",
        action="store_true",
        help="TrainingArguments.dataloader_persistent_workers (needs --dataloader-num-workers)",
    )
    p.add_argument(
        "--dataloader-pin-memory",
        choices=("true", "false"),
        default="true",
        help="TrainingArguments.dataloader_pin_memory (pinning needs an accelerator: a no-op "
        "on CPU)",
    )
    p.add_argument(
        "--jit-checkpoint",
        choices=("true", "false"),
        default="true",
        help="TrainingArguments.enable_jit_checkpoint; false: a SIGTERM ends the process with no "
        "save (periodic checkpoints only, as benchmarks/goodput.py's policy (b))",
    )
    p.add_argument(
        "--full-determinism",
        action="store_true",
        help="TrainingArguments.full_determinism (bit-identical resume with 3+ DDP ranks)",
    )
    p.add_argument(
        "--save-async",
        choices=("auto", "true", "false"),
        default="auto",
        help="TrainingArguments.save_async (auto: None, the default)",
    )
    p.add_argument(
        "--fsdp", default=None, help="shard with FSDP: TrainingArguments.fsdp, e.g. full_shard"
    )
    p.add_argument(
        "--fsdp-config", default=None, help="TrainingArguments.fsdp_config as a JSON object"
    )
    args = p.parse_args(argv)
    for name in ("max_steps", "save_steps", "batch_size", "num_samples", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.save_sleep > 0 and args.enospc_after_bytes is not None:
        p.error("--save-sleep and --enospc-after-bytes cannot be combined: pick one fault")
    if args.output_dir is None:
        args.output_dir = os.environ.get(ENV_OUTPUT_DIR) or None
    if not args.output_dir:
        p.error(f"no output dir: pass --output-dir URL or set ${ENV_OUTPUT_DIR}")
    return args


def _checkpoint_step(checkpoint: Any, default: int) -> int:
    """The step in a checkpoint directory's name (``.../checkpoint-12``), else ``default``."""
    match = re.search(r"checkpoint-(\d+)/?$", str(checkpoint or ""))
    return int(match.group(1)) if match else default


def _fault_url(url: str, protocol: str) -> str:
    """Route a local output dir through one of the test filesystems."""
    if "://" in url and not url.startswith("file://"):
        raise SystemExit(
            f"--save-sleep/--enospc-after-bytes need a local output dir, got {url!r}: "
            "pass a plain path or a file:// URL"
        )
    path = url.removeprefix("file://")
    return f"{protocol}://{os.path.abspath(path)}"


def _make_callback(args: argparse.Namespace) -> Any:
    from trainer_runtime.callbacks import TrainerCallback

    events = args.events_file

    class ToyCallback(TrainerCallback):
        """Progress lines, events for tests, and the injected failure."""

        def on_train_begin(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            testing.append_event(events, "train_begin", step=state.global_step)
            print(f"[toy] train begin at step {state.global_step}/{state.max_steps}", flush=True)
            if args.train_begin_sleep > 0:
                time.sleep(args.train_begin_sleep)

        def on_step_begin(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            step = state.global_step + 1
            testing.append_event(events, "step_begin", step=step)
            own_rank = int(os.environ.get("RANK", "0"))
            if (
                args.fail_at_step is not None
                and step == args.fail_at_step
                and args.fail_rank in (None, own_rank)
            ):
                raise RuntimeError(f"toy: injected failure at step {step} (--fail-at-step)")

        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            testing.append_event(events, "step_end", step=state.global_step)

        def on_substep_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            testing.append_event(events, "substep_end", step=state.global_step + 1)

        def on_evaluate(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            testing.append_event(events, "evaluate", step=state.global_step)

        def on_log(self, targs: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                print(
                    f"[toy] step {state.global_step}/{state.max_steps} loss {logs['loss']:.4f}",
                    flush=True,
                )

        def on_save(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            # The checkpoint's own step: a background save (save_async) commits, and calls
            # on_save, a step or more after the step it holds.
            step = _checkpoint_step(kw.get("checkpoint"), state.global_step)
            testing.append_event(events, "save", step=step)
            print(f"[toy] checkpoint saved at step {step}", flush=True)

        def on_train_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            testing.append_event(events, "train_end", step=state.global_step)

    return ToyCallback()


def build_trainer(args: argparse.Namespace) -> Any:
    """The Trainer the toy runs (also used by the resume benchmark)."""
    from trainer_runtime.trainer import Trainer
    from trainer_runtime.training_args import TrainingArguments

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # model init
    model = ToyModel(dropout=args.dropout)
    if args.ballast_mb > 0:
        # Bytes that every checkpoint carries and training never touches (a buffer outside the
        # forward pass, made without the RNG): saves take as long as a real model's would.
        count = (args.ballast_mb << 20) // 4
        model.register_buffer("ballast", torch.arange(count, dtype=torch.float32) % 251)
    if args.step_sleep > 0:
        # Inside the forward pass: a signal sent "mid-step" really lands in a step in flight.
        delay = args.step_sleep
        model.register_forward_pre_hook(lambda _m, _a: time.sleep(delay))

    if args.eval_sleep > 0:
        # In eval mode only: an evaluation during training is slow, training is not.
        eval_delay, eval_events = args.eval_sleep, args.events_file

        def slow_eval(module: nn.Module, _args: Any) -> None:
            if not module.training:
                testing.append_event(eval_events, "eval_batch")
                time.sleep(eval_delay)

        model.register_forward_pre_hook(slow_eval)

    output_dir = args.output_dir
    if args.save_sleep > 0 or args.enospc_after_bytes is not None or args.events_file:
        testing.register_test_filesystems()
        testing.configure_faults(
            save_sleep=args.save_sleep,
            enospc_after_bytes=args.enospc_after_bytes,
            events_file=args.events_file,
        )
        if args.enospc_after_bytes is not None:
            output_dir = _fault_url(output_dir, "fulldiskfile")
        elif args.save_sleep > 0:
            output_dir = _fault_url(output_dir, "slowfile")

    targs = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        save_on_each_node=args.save_on_each_node,
        logging_steps=args.logging_steps,
        seed=args.seed,
        full_determinism=args.full_determinism,
        enable_jit_checkpoint=args.jit_checkpoint == "true",
        use_cpu=True,
        report_to="none",
        dataloader_num_workers=args.dataloader_num_workers,
        dataloader_persistent_workers=args.dataloader_persistent_workers,
        dataloader_pin_memory=args.dataloader_pin_memory == "true",
        fsdp=args.fsdp,
        fsdp_config=args.fsdp_config,
        save_async={"auto": None, "true": True, "false": False}[args.save_async],
        per_device_eval_batch_size=args.eval_batch_size,
        **({"jit_stop_policy": args.stop_policy} if args.stop_policy else {}),
        **({"eval_strategy": "steps", "eval_steps": args.eval_steps} if args.eval_steps else {}),
        **({"accelerator_config": args.accelerator_config} if args.accelerator_config else {}),
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=ToyDataset(args.num_samples, seed=args.seed, with_index=args.record_samples),
        eval_dataset=ToyDataset(args.eval_samples, seed=args.seed + 2) if args.eval_steps else None,
        callbacks=[_make_callback(args)],
    )
    if args.record_samples:
        _record_samples(trainer, model, args.events_file)
    return trainer


def _record_samples(trainer: Any, model: nn.Module, events_file: str | None) -> None:
    """A 'samples' event per training forward pass: which dataset indices this rank trained on."""

    def hook(module: nn.Module, _args: Any, kwargs: dict[str, Any]) -> None:
        index = kwargs.get("index")
        if not module.training or index is None:
            return
        testing.append_event(
            events_file,
            "samples",
            step=trainer.state.global_step + 1,
            indices=[int(i) for i in index.reshape(-1).tolist()],
            padding=bool(trainer.in_padding_batch),
        )

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _predict(trainer: Any, args: argparse.Namespace) -> None:
    """Predict a fresh labelled set; the event says how many rows came back, in which order."""
    dataset = ToyDataset(args.predict_samples, seed=args.seed + 1)
    output = trainer.predict(dataset)
    testing.append_event(
        args.events_file,
        "predict",
        rows=int(output.predictions.shape[0]),
        label_ids=[int(x) for x in output.label_ids.reshape(-1).tolist()],
        expected=[int(x) for x in dataset.labels.tolist()],
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    trainer = build_trainer(args)
    print(
        f"[toy] output_dir={trainer.args.output_dir} max_steps={args.max_steps} "
        f"save_steps={args.save_steps} seed={args.seed} pid={os.getpid()}",
        flush=True,
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from)
    if args.predict_samples > 0:
        _predict(trainer, args)
    state = trainer.state
    loss = getattr(result, "training_loss", math.nan)
    if state.global_step < args.max_steps:
        # Only reachable as a plain library run (no operator env): a JIT stop returns here.
        print(
            f"[toy] stopped early at step {state.global_step}/{args.max_steps} "
            "(preempted; resume with --resume-from latest)",
            flush=True,
        )
        from trainer_runtime.protocol import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    print(f"[toy] finished at step {state.global_step} training_loss {loss:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    collectives.run_and_exit(main)
