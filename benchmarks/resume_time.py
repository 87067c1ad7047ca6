"""Resume time versus steps already done, for a map-style dataset (``make bench``).

Measures, for checkpoints at step 100 and step 10,000 of the same run, the seconds from the
construction of a new ``Trainer`` to the first new step starting (``on_step_begin``) when it
resumes from that checkpoint. The data position of a map-style dataset is restored through the
batch sampler's state (its order is a pure function of seed and epoch), so this time must not grow
with the step: nothing iterates the batches already consumed. For contrast it also times what a
resume that *did* iterate them would pay (pulling that many batches from a DataLoader).

    python benchmarks/resume_time.py [--steps 100,10000] [--samples 100000] [--repeats 3]

Both checkpoints come from one real training run of the toy model (10,000 tiny CPU steps, about
half a minute on an idle core), in the same epoch of a 100,000-sample dataset, so the step-10,000
checkpoint sits 10,000 batches into its epoch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from trainer_runtime.callbacks import TrainerCallback
from trainer_runtime.toy import ToyDataset, ToyModel
from trainer_runtime.trainer import Trainer
from trainer_runtime.training_args import TrainingArguments

BATCH_SIZE = 8


class SaveOnlyAt(TrainerCallback):
    """Let only the periodic saves at the chosen steps happen (one run, two checkpoints)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        control.should_save = state.global_step in self.steps
        return control


class FirstStepClock(TrainerCallback):
    """Records when the first step of a (resumed) run begins, then asks the run to stop."""

    def __init__(self) -> None:
        self.first_step_at: float | None = None
        self.first_step: int | None = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()
            self.first_step = state.global_step + 1
        control.should_training_stop = True
        return control


def _trainer(
    output_dir: Path, dataset: ToyDataset, max_steps: int, callbacks: list[TrainerCallback]
) -> Trainer:
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        per_device_train_batch_size=BATCH_SIZE,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=1,  # SaveOnlyAt decides
        logging_steps=1000,
        enable_jit_checkpoint=False,
        use_cpu=True,
        report_to="none",
        seed=0,
    )
    return Trainer(model=ToyModel(), args=args, train_dataset=dataset, callbacks=callbacks)


def _resume_seconds(
    checkpoint: Path, dataset: ToyDataset, workdir: Path, expect_step: int
) -> float:
    scratch = Path(tempfile.mkdtemp(dir=workdir, prefix="resume-"))
    clock = FirstStepClock()
    started = time.perf_counter()
    trainer = _trainer(scratch, dataset, expect_step + 1000, [clock, SaveOnlyAt(set())])
    trainer.train(resume_from_checkpoint=str(checkpoint))
    shutil.rmtree(scratch, ignore_errors=True)
    if clock.first_step_at is None or clock.first_step != expect_step + 1:
        raise SystemExit(f"resume from {checkpoint} began at step {clock.first_step}")
    return clock.first_step_at - started


def _iterate_seconds(dataset: ToyDataset, batches: int) -> float:
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True, generator=gen)
    started = time.perf_counter()
    for i, _ in enumerate(loader, start=1):
        if i >= batches:
            break
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--steps", default="100,10000", help="checkpoint steps to compare")
    p.add_argument("--samples", type=int, default=100_000, help="map-style dataset size")
    p.add_argument("--repeats", type=int, default=3, help="resumes timed per checkpoint")
    p.add_argument("--workdir", default=None, help="keep the checkpoints here (default: temp)")
    args = p.parse_args(argv)
    steps = sorted({int(s) for s in args.steps.split(",") if s.strip()})
    if not steps or steps[0] < 1:
        p.error(f"--steps={args.steps!r}: give positive step numbers, e.g. 100,10000")
    if steps[-1] * BATCH_SIZE > args.samples:
        p.error(f"--samples={args.samples} is under one epoch for {steps[-1]} steps")
    for key in [k for k in os.environ if k.startswith("PREEMPTIBLE_")]:
        del os.environ[key]  # a plain library run: no operator environment, no JIT exit
    torch.set_num_threads(1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="resume-bench-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    dataset = ToyDataset(args.samples, seed=0)

    print(f"training {steps[-1]} steps (batch {BATCH_SIZE}, {args.samples} samples) ...")
    started = time.perf_counter()
    train_dir = workdir / "train"
    _trainer(train_dir, dataset, steps[-1], [SaveOnlyAt(set(steps))]).train()
    train_seconds = time.perf_counter() - started
    print(f"trained in {train_seconds:.1f}s ({1000 * train_seconds / steps[-1]:.2f} ms/step)")

    _resume_seconds(train_dir / f"checkpoint-{steps[0]}", dataset, workdir, steps[0])  # warm-up
    rows = []
    for step in steps:
        times = [
            _resume_seconds(train_dir / f"checkpoint-{step}", dataset, workdir, step)
            for _ in range(args.repeats)
        ]
        rows.append((step, statistics.median(times), min(times), max(times)))
        rows[-1] += (_iterate_seconds(dataset, step),)

    print()
    print(f"resume time: Trainer() -> first new step begins (median of {args.repeats})")
    header = ("checkpoint step", "resume s (median)", "min", "max", "iterating instead s")
    print("  ".join(f"{h:>19}" for h in header))
    for step, med, lo, hi, naive in rows:
        cells = (f"{step}", f"{med:.3f}", f"{lo:.3f}", f"{hi:.3f}", f"{naive:.3f}")
        print("  ".join(f"{c:>19}" for c in cells))
    ratio = rows[-1][1] / rows[0][1]
    print(f"\nstep {steps[-1]} / step {steps[0]} resume time ratio: {ratio:.2f}")
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
