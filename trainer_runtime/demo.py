"""``make demo``: preempt a real training process with SIGTERM, resume it, prove nothing was lost.

    python -m trainer_runtime.demo [--output-dir DIR] [--max-steps N] [--kill-wait S] ...

Stages (every output line is prefixed with its stage):

1. ``train``     the toy model trains in a subprocess, with the environment the operator sets
                 (PREEMPTIBLE_OUTPUT_DIR, PREEMPTIBLE_ATTEMPT, a termination-log file);
2. ``preempt``   a real SIGTERM (``os.kill``) once step ``--preempt-at-step`` has ended; the
                 runtime waits kill_wait seconds, finishes the step in flight, writes a JIT
                 checkpoint and exits with code 75 and a termination message;
3. ``inspect``   ``trainer-runtime inspect`` on the output dir;
4. ``resume``    a new subprocess (attempt 2) resumes from the newest complete checkpoint;
5. ``reference`` the same training, uninterrupted, in a separate output dir;
6. ``verify``    every tensor of the final model.safetensors of both runs compared with torch.equal;
7. ``grace``     ``trainer-runtime grace``: the terminationGracePeriodSeconds the measured step and
                 save times call for.

Exits 0 only if every check passed. Everything is written under ``--output-dir``
(default ``./demo-output``), which is emptied first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_KILL_WAIT_SECONDS,
    ENV_METRICS_PORT,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    ENV_TERMINATION_LOG,
    EXIT_PREEMPTED,
    read_termination_message,
)
from trainer_runtime.testing import read_events, weights_identical

__all__ = ["main"]


class DemoFailure(Exception):
    """A check of the demo failed; the message says which and why."""


def say(stage: str, text: str) -> None:
    for line in text.splitlines() or [""]:
        print(f"[{stage:<9}] {line}", flush=True)


def _pump(stream: IO[bytes], stage: str, log: IO[bytes]) -> None:
    for raw in iter(stream.readline, b""):
        log.write(raw)
        log.flush()
        say(stage, raw.decode(errors="replace").rstrip("\n"))


class Run:
    """A toy training subprocess whose output is shown live, prefixed with the stage name."""

    def __init__(
        self,
        stage: str,
        output_dir: Path,
        workdir: Path,
        toy_args: Sequence[str],
        *,
        attempt: int,
        resume_from: str = "",
        kill_wait: float | None,
    ) -> None:
        self.stage = stage
        self.events_file = workdir / f"{stage}-events.jsonl"
        self.termination_log = workdir / f"{stage}-termination-message.json"
        self.log_path = workdir / f"{stage}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
        env.pop(ENV_METRICS_PORT, None)
        env.update(
            {
                ENV_OUTPUT_DIR: str(output_dir),
                ENV_ATTEMPT: str(attempt),
                ENV_RESUME_FROM: resume_from,
                ENV_TERMINATION_LOG: str(self.termination_log),
                "OMP_NUM_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if kill_wait is not None:
            env[ENV_KILL_WAIT_SECONDS] = str(kill_wait)
        cmd = [
            sys.executable,
            "-m",
            "trainer_runtime.toy",
            *toy_args,
            "--events-file",
            str(self.events_file),
        ]
        say(
            stage,
            f"$ {ENV_ATTEMPT}={attempt} {ENV_RESUME_FROM}={resume_from!r} python -m "
            f"trainer_runtime.toy {' '.join(toy_args)}",
        )
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        assert self.proc.stdout is not None
        self._pump = threading.Thread(
            target=_pump, args=(self.proc.stdout, stage, self._log), daemon=True
        )
        self._pump.start()

    def wait_for_step_end(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(
                e.get("event") == "step_end" and int(e.get("step", -1)) >= step
                for e in read_events(self.events_file)
            ):
                return
            if self.proc.poll() is not None:
                raise DemoFailure(
                    f"training exited with {self.proc.returncode} before step {step} ended "
                    f"(log: {self.log_path})"
                )
            time.sleep(0.02)
        raise DemoFailure(f"step {step} did not end within {timeout:.0f}s (log: {self.log_path})")

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise DemoFailure(
                f"{self.stage} run still running after {timeout:.0f}s; killed it"
            ) from None
        self._pump.join(timeout=10)
        self._log.close()
        return code


def _cli(stage: str, *args: str) -> int:
    """Run ``trainer-runtime <args>`` (the console script of this environment) and show it."""
    script = Path(sys.executable).with_name("trainer-runtime")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "trainer_runtime.cli"]
    say(stage, "$ trainer-runtime " + " ".join(args))
    proc = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    say(stage, (proc.stdout + proc.stderr).rstrip())
    return proc.returncode


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer_runtime.demo", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument(
        "--output-dir", default="demo-output", help="everything goes here (emptied first)"
    )
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--save-steps", type=int, default=25)
    p.add_argument("--step-sleep", type=float, default=0.1, help="seconds per step (a slow model)")
    p.add_argument("--preempt-at-step", type=int, default=30, help="SIGTERM once this step ended")
    p.add_argument(
        "--kill-wait",
        type=float,
        default=None,
        help=f"${ENV_KILL_WAIT_SECONDS} for the preempted run (default: the runtime's 3 s)",
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per training run")
    args = p.parse_args(argv)
    if not 0 < args.preempt_at_step < args.max_steps:
        p.error(
            f"--preempt-at-step={args.preempt_at_step} must be between 1 and "
            f"--max-steps - 1 ({args.max_steps - 1})"
        )
    return args


def run_demo(args: argparse.Namespace) -> None:
    root = Path(args.output_dir).resolve()
    if root.exists():
        shutil.rmtree(root)
    preempted_dir, reference_dir, work = root / "preempted", root / "reference", root / "logs"
    for d in (preempted_dir, reference_dir, work):
        d.mkdir(parents=True)
    toy_args = [
        "--max-steps", str(args.max_steps),
        "--save-steps", str(args.save_steps),
        "--step-sleep", str(args.step_sleep),
        "--seed", str(args.seed),
    ]  # fmt: skip
    say("setup", f"output under {root}")
    say(
        "setup",
        f"toy MLP with dropout, {args.max_steps} steps, checkpoint every "
        f"{args.save_steps}, {args.step_sleep}s per step, CPU, 1 thread",
    )

    # 1-2. train, then preempt with a real SIGTERM.
    run = Run("train", preempted_dir, work, toy_args, attempt=1, kill_wait=args.kill_wait)
    run.wait_for_step_end(args.preempt_at_step, timeout=args.timeout)
    os.kill(run.proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    say("preempt", f"step {args.preempt_at_step} ended: sent SIGTERM to pid {run.proc.pid}")
    code = run.wait(timeout=args.timeout)
    say(
        "preempt",
        f"process exited with code {code} after {time.monotonic() - sent:.2f}s "
        f"(expected {EXIT_PREEMPTED}: preempted, not a success and not a crash)",
    )
    if code != EXIT_PREEMPTED:
        raise DemoFailure(f"preempted run exited with {code}, expected {EXIT_PREEMPTED}")
    raw = run.termination_log.read_text(encoding="utf-8") if run.termination_log.exists() else ""
    msg = read_termination_message(raw)
    if msg is None:
        raise DemoFailure(f"no valid termination message in {run.termination_log}: {raw!r}")
    say("preempt", "termination message: " + json.dumps(json.loads(raw), indent=2))
    if msg.reason != "preempted" or not msg.complete or not msg.checkpoint:
        raise DemoFailure(f"termination message is not a complete preemption: {msg!r}")
    if not msg.step > args.preempt_at_step - 1:
        raise DemoFailure(f"JIT checkpoint at step {msg.step} < step {args.preempt_at_step}")
    say(
        "preempt",
        f"JIT checkpoint {msg.checkpoint} at step {msg.step} "
        f"({msg.step - args.preempt_at_step} steps ran during the kill wait)",
    )

    # 3. inspect
    if _cli("inspect", "inspect", str(preempted_dir)) != 0:
        raise DemoFailure("trainer-runtime inspect failed")

    # 4. resume in a new process, as the operator's next attempt would.
    resume = Run("resume", preempted_dir, work, toy_args, attempt=2, resume_from="latest",
                 kill_wait=args.kill_wait)  # fmt: skip
    code = resume.wait(timeout=args.timeout)
    if code != 0:
        raise DemoFailure(f"resumed run exited with {code} (log: {resume.log_path})")
    first = next((e["step"] for e in read_events(resume.events_file)
                  if e.get("event") == "step_begin"), None)  # fmt: skip
    say("resume", f"resumed run started at step {first} and finished (exit 0)")
    if first != msg.step + 1:
        raise DemoFailure(f"resume started at step {first}, expected {msg.step + 1}")

    # 5. reference
    ref_args = [*toy_args[:4], "--seed", str(args.seed)]  # no step sleep: same math, faster
    reference = Run("reference", reference_dir, work, ref_args, attempt=1, kill_wait=args.kill_wait)
    code = reference.wait(timeout=args.timeout)
    if code != 0:
        raise DemoFailure(f"reference run exited with {code} (log: {reference.log_path})")

    # 6. verify
    final = f"checkpoint-{args.max_steps}"
    same, detail = weights_identical(preempted_dir / final, reference_dir / final)
    say("verify", f"preempted+resumed {final}/model.safetensors vs uninterrupted: {detail}")
    if not same:
        raise DemoFailure(f"final weights differ: {detail}")

    # 7. grace
    if _cli("grace", "grace", str(preempted_dir)) != 0:
        raise DemoFailure("trainer-runtime grace failed")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    try:
        run_demo(args)
    except DemoFailure as exc:
        say("FAILED", str(exc))
        return 1
    say("PASSED", f"preempted, resumed and bit-identical in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
