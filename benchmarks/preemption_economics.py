"""Preemption economics of the two JIT stop policies, measured on the toy with long accumulated
steps (real processes, real SIGTERMs), and the checkpoint interval for a job preempted often.

Part 1: for each stop policy (``finish_step``, ``micro_batch``) the toy trains with
``--ga`` micro-batches per optimizer step, each ``--micro`` seconds long (a forward-pass sleep,
so one step lasts about ga x micro seconds), checkpoints slowed to ``--save-sleep`` seconds per
file. A SIGTERM lands after 1, ga/2 and ga-1 micro-batches of a step; the script prints the
measured SIGTERM-to-exit seconds (how long the preempted GPUs stay busy), the grace period the
rule asks for with the measured timings (operator defaults: 25 % headroom, 5 s exit margin,
this run's kill_wait), and the GPU-seconds each preemption frees compared with ``finish_step``
(per GPU: multiply by the job's GPUs).

Part 2: one job preempted ``--preemptions`` times, each attempt running ``--run-seconds`` before its
SIGTERM and resuming from its JIT checkpoint: the operator's recommended checkpoint interval
sqrt(2 x save x mean time between preemptions) from the measured save time and running time
(printed without the operator's 30 s floor, which the toy's seconds-long runs would hit).

    python benchmarks/preemption_economics.py [--ga 8] [--micro 0.25] [--save-sleep 0.1]
        [--kill-wait 0.5] [--preemptions 3] [--run-seconds 6]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from preemptible_operator.interval import recommend_interval
from trainer_runtime.grace import GracePolicy, recommend_grace
from trainer_runtime.protocol import EXIT_PREEMPTED, TerminationMessage
from trainer_runtime.testing import ToyRun

TIMEOUT = 300.0


def _toy_args(ga: int, micro: float, save_sleep: float, policy: str) -> list[str]:
    return [
        "--max-steps",
        "1000",
        "--save-steps",
        "2",
        "--gradient-accumulation-steps",
        str(ga),
        "--step-sleep",
        str(micro),
        "--save-sleep",
        str(save_sleep),
        "--stop-policy",
        policy,
        "--num-samples",
        "4096",
        "--logging-steps",
        "1000",
    ]


def _preempt_once(
    root: Path, ga: int, micro: float, save_sleep: float, policy: str, after: int, kill_wait: float
) -> TerminationMessage:
    """Train to step 3 (periodic save at 2 measured), SIGTERM after ``after`` micro-batches of
    step 4, return the termination message."""
    run = ToyRun(
        root / "out", root, args=_toy_args(ga, micro, save_sleep, policy), kill_wait=kill_wait
    ).start()
    try:
        run.wait_for_event("save", step=2, timeout=TIMEOUT)
        # the ``after``-th micro-batch of step 4 ended
        run.wait_for_event("substep_end", step=4, timeout=TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        while (
            sum(1 for e in run.events() if e["event"] == "substep_end" and e["step"] == 4) < after
        ):
            if time.monotonic() > deadline:
                sys.exit(f"no micro-batch {after} of step 4\n{run.tail()}")
            time.sleep(0.01)
        run.send(signal.SIGTERM)
        code = run.wait(TIMEOUT)
    finally:
        run.kill()
    if code != EXIT_PREEMPTED:
        sys.exit(f"toy exited {code}, expected {EXIT_PREEMPTED}\n{run.tail()}")
    return run.termination_message()


def part_one(args: argparse.Namespace, work: Path) -> None:
    positions = sorted({1, max(1, args.ga // 2), max(1, args.ga - 1)})
    print(
        f"toy: {args.ga} micro-batches of {args.micro:g} s per step (a step ~ "
        f"{args.ga * args.micro:.1f} s), {args.save_sleep:g} s per checkpoint file, kill_wait "
        f"{args.kill_wait:g} s; SIGTERM after {positions} micro-batches of step 4\n"
    )
    rows = []
    results: dict[str, float] = {}
    for policy in ("finish_step", "micro_batch"):
        exits, msgs = [], []
        for after in positions:
            root = work / f"{policy}-{after}"
            msg = _preempt_once(
                root, args.ga, args.micro, args.save_sleep, policy, after, args.kill_wait
            )
            assert msg.sigterm_to_exit_seconds is not None
            exits.append(msg.sigterm_to_exit_seconds)
            msgs.append(msg)
        step_max = max(m.step_seconds.max or 0 for m in msgs)
        save_max = max(m.save_seconds.max or 0 for m in msgs)
        micro_max = max(
            (m.micro_batch_seconds.max or 0) if m.micro_batch_seconds else 0 for m in msgs
        )
        rec = recommend_grace(
            step_max,
            save_max,
            None,
            GracePolicy(kill_wait=args.kill_wait, stop_policy=policy, minimum=1),
            micro_batch_max=micro_max,
        )
        mean_exit = statistics.mean(exits)
        results[policy] = mean_exit
        stops = sorted({m.stop or "?" for m in msgs})
        rows.append(
            (policy, mean_exit, max(exits), rec.seconds, step_max, micro_max, save_max, stops)
        )
    print(
        f"{'policy':<12} {'SIGTERM->exit mean':>18} {'max':>6} {'grace rule':>10} "
        f"{'step max':>8} {'micro max':>9} {'save max':>8}  stops"
    )
    for policy, mean, worst, grace, step, micro, save, stops in rows:
        print(
            f"{policy:<12} {mean:>16.2f} s {worst:>5.2f}s {grace:>8d} s {step:>7.2f}s "
            f"{micro:>8.2f}s {save:>7.2f}s  {','.join(stops)}"
        )
    freed = results["finish_step"] - results["micro_batch"]
    print(
        f"\nmicro_batch frees the preempted GPUs {freed:.2f} s sooner per preemption on average "
        f"({freed:.2f} GPU-seconds per GPU; x8 GPUs: {8 * freed:.1f} GPU-seconds)\n"
    )


def part_two(args: argparse.Namespace, work: Path) -> None:
    out = work / "often" / "out"
    running = 0.0
    saves: list[float] = []
    for attempt in range(1, args.preemptions + 1):
        run = ToyRun(
            out,
            work / "often",
            args=_toy_args(args.ga, args.micro / 4, args.save_sleep, "finish_step"),
            attempt=attempt,
            resume_from="latest" if attempt > 1 else None,
            kill_wait=args.kill_wait,
        ).start()
        try:
            run.wait_for_event("step_begin", timeout=TIMEOUT)
            started = time.monotonic()
            time.sleep(args.run_seconds)
            sent = run.send(signal.SIGTERM)
            code = run.wait(TIMEOUT)
        finally:
            run.kill()
        if code != EXIT_PREEMPTED:
            sys.exit(f"attempt {attempt} exited {code}\n{run.tail()}")
        running += sent - started
        msg = run.termination_message()
        if msg.save_seconds.last is not None:
            saves.append(msg.save_seconds.last)
        print(
            f"attempt {attempt}: ran {sent - started:.1f} s, preempted at step {msg.step}, "
            f"JIT save {msg.save_seconds.last or 0:.2f} s"
        )
    rec = recommend_interval(saves[-1] if saves else None, running, args.preemptions, minimum=1)
    print(f"recommended checkpoint interval: {rec.seconds} s ({rec.reason})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ga", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--micro", type=float, default=0.25, help="seconds per micro-batch")
    p.add_argument("--save-sleep", type=float, default=0.1, help="seconds per checkpoint file")
    p.add_argument("--kill-wait", type=float, default=0.5, help="PREEMPTIBLE_KILL_WAIT_SECONDS")
    p.add_argument("--preemptions", type=int, default=3)
    p.add_argument("--run-seconds", type=float, default=6.0, help="running time per attempt")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="preemption-economics-") as tmp:
        part_one(args, Path(tmp))
        part_two(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
