"""Per-step cost of the rank agreement on stopping (``collectives.agree_to_stop``).

Every optimizer step, every rank calls ``agree_to_stop(local_flag)``: one all-reduce (MAX) of one
int32. This prints its cost in one process (a no-op) and across ``--ranks`` real processes on gloo
(CPU), next to the step of a small data-parallel model measured in the same process group, and
checks it against the 1 % budget of a realistic step (``--step-seconds``, default 0.1 s: a fast
data-parallel step; most real steps are longer).

    python benchmarks/agreement_overhead.py [--ranks 2] [--calls 2000] [--step-seconds 0.1]

Exit status 1 when the agreement costs more than 1 % of ``--step-seconds``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainer_runtime.distributed import collectives

BUDGET = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_calls(calls: int, flag: bool = False) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        collectives.agree_to_stop(flag)
        samples.append(time.perf_counter() - start)
    return samples


def _ddp_step_seconds(steps: int) -> float:
    """Median step of a small MLP (about 1M parameters) under DDP on this process group."""
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 512)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _worker(rank: int, world: int, port: int, calls: int, queue: mp.Queue[object]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _time_calls(50)  # warm up the connections
        samples = _time_calls(calls)
        # A stop requested by the last rank only must reach every rank in the same call.
        agreed = collectives.agree_to_stop(rank == world - 1)
        step = _ddp_step_seconds(12)
        queue.put((rank, samples, agreed, step))
    finally:
        dist.destroy_process_group()


def _p(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    args = parser.parse_args(argv)

    single = _time_calls(args.calls)
    print(
        f"1 process   : agree_to_stop median {statistics.median(single) * 1e6:8.2f} us "
        f"p99 {_p(single, 0.99) * 1e6:8.2f} us (no collective)"
    )

    ctx = mp.get_context("spawn")
    queue: mp.Queue[object] = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.ranks, port, args.calls, queue))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    results.sort(key=lambda r: r[0])  # type: ignore[index]
    worst = 0.0
    for rank, samples, agreed, step in results:  # type: ignore[misc]
        median = statistics.median(samples)
        worst = max(worst, median)
        print(
            f"{args.ranks} processes: rank {rank} agree_to_stop median {median * 1e6:8.2f} us "
            f"p99 {_p(samples, 0.99) * 1e6:8.2f} us; small DDP step {step * 1e3:7.2f} ms "
            f"({median / step:.2%} of it); one rank's stop seen: {agreed}"
        )
        if not agreed:
            print("ERROR: a stop requested by one rank did not reach every rank")
            return 1
    share = worst / args.step_seconds
    verdict = "OK" if share < BUDGET else "ABOVE BUDGET"
    print(
        f"worst median {worst * 1e6:.2f} us = {share:.4%} of a {args.step_seconds:g} s step "
        f"(budget {BUDGET:.0%}): {verdict}"
    )
    return 0 if share < BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
