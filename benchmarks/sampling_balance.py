"""Padding waste and micro-batch balance of the training samplers on skewed sample lengths.

For "random", "group_by_length" and "batch_rebalance" it plans one epoch for every rank (no model,
no data loading: only the samplers' index plans and the lengths) and prints

* the padded-token fraction: padding / (tokens after padding each micro-batch to its longest),
* the spread of the per-micro-batch padded cost (max length * count) over every micro-batch of the
  epoch, all ranks: coefficient of variation (std / mean) and max / mean. This is the cost a device
  pays for one forward/backward: a steady cost means predictable step times and a batch size that
  can be set close to the memory limit,
* per optimizer step, the coefficient of variation of the micro-batches' padded cost across all
  ranks and accumulation steps, averaged over the steps,
* per optimizer step, the sync idle fraction: each rank's summed padded cost over its accumulation
  micro-batches, 1 - mean / max over ranks (the share of device time spent waiting for the slowest
  rank at the gradient all-reduce, if time is proportional to padded tokens),
* the largest micro-batch padded cost (a proxy of peak activation memory),
* the time to plan the epoch.

Usage: python benchmarks/sampling_balance.py [--samples N] [--world-size W] [--grad-accum A]
       [--batch-size B] [--seed S] [--distribution pareto|lognormal]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections.abc import Callable

from trainer_runtime.data.length_sampling import (
    BatchRebalanceBatchSampler,
    LengthGroupedBatchSampler,
    padded_cost,
)
from trainer_runtime.data.samplers import RandomBatchSampler, ResumableBatchSampler


def make_lengths(n: int, seed: int, distribution: str) -> list[int]:
    """Token counts with a long tail (most samples short, a few up to the context length)."""
    rng = random.Random(seed)
    if distribution == "pareto":
        return [min(2048, int(16 * rng.paretovariate(1.2))) for _ in range(n)]
    return [max(1, min(2048, int(rng.lognormvariate(math.log(120), 0.9)))) for _ in range(n)]


def plan_all_ranks(
    make: Callable[[int], ResumableBatchSampler], world: int
) -> tuple[list[list[list[int]]], float]:
    start = time.perf_counter()
    plans = [list(make(rank)) for rank in range(world)]
    return plans, time.perf_counter() - start


def measure(plans: list[list[list[int]]], lengths: list[int], accum: int) -> dict[str, float]:
    """The figures of one strategy (see the module docstring)."""
    micro = [b for rank_plan in plans for b in rank_plan]
    real = sum(lengths[i] for b in micro for i in b)
    all_costs = [padded_cost([lengths[i] for i in b]) for b in micro]
    run_mean = statistics.mean(all_costs)
    step_cvs, idle = [], []
    full_steps = len(plans[0]) // accum
    for s in range(full_steps):
        per_rank = [
            [padded_cost([lengths[i] for i in b]) for b in plan[s * accum : (s + 1) * accum]]
            for plan in plans
        ]
        costs = [c for rank_costs in per_rank for c in rank_costs]
        step_cvs.append(statistics.pstdev(costs) / statistics.mean(costs))
        totals = [sum(rank_costs) for rank_costs in per_rank]
        idle.append(1 - statistics.mean(totals) / max(totals))
    return {
        "padding": 1 - real / sum(all_costs),
        "cv": statistics.pstdev(all_costs) / run_mean,
        "max_mean": max(all_costs) / run_mean,
        "step_cv": statistics.mean(step_cvs),
        "idle": statistics.mean(idle),
        "peak": max(all_costs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distribution", choices=["pareto", "lognormal"], default="lognormal")
    args = parser.parse_args(argv)

    lengths = make_lengths(args.samples, args.seed, args.distribution)
    world, accum, bs = args.world_size, args.grad_accum, args.batch_size
    common = {"seed": args.seed, "num_replicas": world}
    samplers: dict[str, Callable[[int], ResumableBatchSampler]] = {
        "random": lambda r: RandomBatchSampler(len(lengths), bs, rank=r, **common),
        "group_by_length": lambda r: LengthGroupedBatchSampler(lengths, bs, rank=r, **common),
        "batch_rebalance": lambda r: BatchRebalanceBatchSampler(
            lengths, bs, gradient_accumulation_steps=accum, rank=r, **common
        ),
    }
    print(
        f"{args.samples} samples ({args.distribution}: median {statistics.median(lengths):.0f}, "
        f"mean {statistics.mean(lengths):.0f}, max {max(lengths)} tokens), world_size={world}, "
        f"gradient_accumulation_steps={accum}, per_device_train_batch_size={bs} "
        f"({world * accum * bs} samples per optimizer step)"
    )
    header = (
        f"{'strategy':<16} {'padding':>8} {'cost CV':>8} {'max/mean':>9} {'step CV':>8} "
        f"{'sync idle':>10} {'peak cost':>10} {'plan s':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, make in samplers.items():
        plans, seconds = plan_all_ranks(make, world)
        m = measure(plans, lengths, accum)
        print(
            f"{name:<16} {m['padding']:>8.3f} {m['cv']:>8.3f} {m['max_mean']:>9.2f} "
            f"{m['step_cv']:>8.3f} {m['idle']:>10.3f} {m['peak']:>10,.0f} {seconds:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
