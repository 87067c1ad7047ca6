"""Randomized trials: SIGTERM or SIGKILL at random moments, resume until done, compare bit for bit.

PREEMPTIBLE_TRIALS sets the number of trials (default 4, for CI); PREEMPTIBLE_TRIAL_SEED replays
a run (the seed is printed, and shown with any failure).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.runtime.conftest import (
    RUN_TIMEOUT,
    Reference,
    assert_bit_identical,
    assert_preempted,
    toy_args,
)
from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import EXIT_PREEMPTED
from trainer_runtime.testing import ToyRun

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(900)]

# Slow steps and slow saves, so random moments fall both inside steps and inside saves.
STEP_SLEEP = 0.08
SAVE_SLEEP = 0.08
# A run of the toy trains for roughly this long after train_begin (12 steps, 3 saves).
RUN_SECONDS = 3.0
MAX_INTERRUPTIONS = 3


def _trial(rng: random.Random, out: Path, work: Path, reference: Reference) -> list[str]:
    """One trial: interrupt 1..3 times at random, resume each time, finish; returns a log."""
    history: list[str] = []
    interruptions = rng.randint(1, MAX_INTERRUPTIONS)
    attempt = 0
    while True:
        attempt += 1
        latest = CheckpointStore(str(out)).latest_complete() if out.exists() else None
        # What the operator does: resume from the newest complete checkpoint, if there is one.
        expect_first = latest.step + 1 if latest else 1
        run = ToyRun(
            out,
            work,
            args=toy_args(step_sleep=STEP_SLEEP, save_sleep=SAVE_SLEEP),
            attempt=attempt,
            resume_from="latest" if latest else "",
        ).start()
        sig: signal.Signals | None = None
        try:
            run.wait_for_event("train_begin", timeout=RUN_TIMEOUT)
            if attempt <= interruptions:
                sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
                delay = rng.uniform(0.0, RUN_SECONDS)
                time.sleep(delay)
                if run.proc is not None and run.proc.poll() is None:
                    run.send(sig)
                else:
                    sig = None  # finished before the signal was due
            code = run.wait(RUN_TIMEOUT)
        finally:
            run.kill()
        begun = list(run.steps_begun())
        history.append(
            f"attempt {attempt}: resumed after {latest.name if latest else 'nothing'}, "
            f"signal {sig.name if sig else '-'}, exit {code}, steps {begun[:1]}..{begun[-1:]}"
        )
        # Zero corrupt resumes: each run starts right after the newest COMPLETE checkpoint.
        if begun:
            assert begun[0] == expect_first, f"began at step {begun[0]}, expected {expect_first}"
        if code == 0:
            break
        if code == -signal.SIGTERM:
            # The SIGTERM landed after train() had returned (handler restored, work done): the
            # process dies of the signal, but the message already says "completed".
            msg = run.termination_message()
            assert msg.reason == "completed" and msg.complete, (msg, run.tail())
            history[-1] += " (SIGTERM after completion)"
            break
        if code == EXIT_PREEMPTED:
            assert sig == signal.SIGTERM, f"exit 75 without a SIGTERM\n{run.tail()}"
            assert_preempted(run, code)
        else:
            assert sig == signal.SIGKILL and code == -signal.SIGKILL, (
                f"unexpected exit {code} after {sig}\n{run.tail()}"
            )
        assert attempt <= MAX_INTERRUPTIONS + 1, "too many attempts"
    assert_bit_identical(out, reference)
    # Every checkpoint left behind after the final run is complete (rotation off: all kept),
    # except an abandoned write of an earlier attempt older than the newest complete checkpoint
    # (killed mid-save, its step never saved again because a later attempt's JIT checkpoint came
    # first; seed 112139584): resume skips it, and with save_total_limit unset nothing is
    # removed (layout.rotation_victims, Hugging Face's keep-everything semantics).
    store = CheckpointStore(str(out))
    final = store.latest_complete()
    assert final is not None
    last_attempt = attempt
    leftovers = [
        c
        for c in store.list()
        if not c.complete
        and not (c.step < final.step and c.attempt is not None and c.attempt < last_attempt)
    ]
    assert not leftovers, [(c.name, c.reason, c.attempt) for c in leftovers]
    return history


def test_random_preemptions(tmp_path: Path, reference: Reference) -> None:
    trials = int(os.environ.get("PREEMPTIBLE_TRIALS", "4"))
    seed_env = os.environ.get("PREEMPTIBLE_TRIAL_SEED")
    seed = int(seed_env) if seed_env else random.SystemRandom().randrange(2**31)
    print(f"random preemption: {trials} trials, seed {seed}")
    print(f"replay with PREEMPTIBLE_TRIAL_SEED={seed}")
    rng = random.Random(seed)
    for trial in range(trials):
        work = tmp_path / f"trial-{trial}"
        try:
            history = _trial(rng, work / "out", work, reference)
        except AssertionError as exc:
            raise AssertionError(f"trial {trial} (seed {seed}): {exc}") from exc
        print(f"trial {trial}: " + "; ".join(history))
