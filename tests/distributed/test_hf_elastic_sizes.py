"""An elastic job's stock transformers script (``python -m trainer_runtime.hf.run``, nothing
changed in it) on 2, then 3, then 1 rank(s), one process per node, JIT stops between: the runtime
sets transformers' ``gradient_accumulation_steps`` to keep the global batch
(trainer_runtime/hf/elastic.py), and then transformers and accelerate themselves hand every
optimizer step the same samples as an uninterrupted 2-rank run (micro-batch ``k`` of the seeded
permutation goes to rank ``k mod world_size``; a step is ``world_size x accumulation``
consecutive micro-batches, the same at every size; a resume skips ``steps x accumulation`` per
rank). The run crosses an epoch end and resumes inside the second epoch. The weights end within
a float tolerance of the reference (the same gradients summed in another order, docs/elastic.md);
dropout is off (its masks are drawn per rank)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the hf path needs transformers (dev extra)")

from tests.distributed.ranks import free_port
from trainer_runtime.protocol import EXIT_PREEMPTED, TerminationMessage

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parent / "hf_elastic_script.py"
ROOT = Path(__file__).parent.parent.parent
TIMEOUT = 240.0
REFERENCE_NODES, ACCUMULATION = 2, 3
MAX_STEPS = 8
# 48 rows, 2 per micro-batch: 24 micro-batches an epoch, 6 a step (2 ranks x 3): 4 steps an
# epoch, a global batch of 12; 8 steps are two epochs.
BASE = [
    "--max-steps", str(MAX_STEPS), "--save-steps", "4", "--num-samples", "48",
    "--batch-size", "2", "--grad-accum", str(ACCUMULATION),
]  # fmt: skip
ELASTIC_ENV = {
    "PREEMPTIBLE_ELASTIC_REFERENCE_NODES": str(REFERENCE_NODES),
    "PREEMPTIBLE_ELASTIC_ACCUMULATION": str(ACCUMULATION),
}


def _env(out: Path, work: Path, attempt: int, ranks: int, rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(ranks),
        RANK=str(rank),
        NODE_RANK=str(rank),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        PREEMPTIBLE_OUTPUT_DIR=str(out),
        PREEMPTIBLE_ATTEMPT=str(attempt),
        PREEMPTIBLE_RESUME_FROM="latest",
        PREEMPTIBLE_KILL_WAIT_SECONDS="0",
        PREEMPTIBLE_TERMINATION_LOG=str(work / f"term-a{attempt}-r{rank}"),
    )
    return env


class Attempt:
    """One attempt: ``ranks`` processes of the script under ``trainer_runtime.hf.run``."""

    def __init__(
        self, out: Path, work: Path, attempt: int, ranks: int, env: dict[str, str], *extra: str
    ) -> None:
        port = free_port()
        self.work, self.attempt = work, attempt
        self.record = work / f"rec-a{attempt}"
        self.logs = [work / f"log-a{attempt}-r{rank}.txt" for rank in range(ranks)]
        argv = [str(SCRIPT), "--output-dir", "unused", "--record", str(self.record), *BASE]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with open(log, "wb") as f:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-P", "-m", "trainer_runtime.hf.run", *argv, *extra],
                        cwd=ROOT,
                        env={**_env(out, work, attempt, ranks, rank, port), **env},
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.log(r)[-3000:]}" for r in range(len(self.logs)))

    def wait_for(self, marker: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while marker not in self.log():
            if any(p.poll() is not None for p in self.procs) or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {marker!r}:\n{self.tails()}")
            time.sleep(0.05)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def wait(self) -> list[int]:
        try:
            return [p.wait(TIMEOUT) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running:\n{self.tails()}") from None

    def termination(self, rank: int = 0) -> TerminationMessage:
        path = self.work / f"term-a{self.attempt}-r{rank}"
        return TerminationMessage.model_validate_json(path.read_text())

    def step_samples(self) -> dict[int, list[int]]:
        """step -> the sorted dataset rows every rank trained on in it."""
        steps: dict[int, list[int]] = {}
        for path in sorted(self.record.glob("rank*.jsonl")):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                steps.setdefault(int(record["step"]), []).extend(record["indices"])
        return {step: sorted(rows) for step, rows in steps.items()}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model.safetensors"))


def test_stock_trainer_shrinks_and_grows_with_every_steps_samples_and_the_training(
    tmp_path: Path,
) -> None:
    ref_out, ref_work = tmp_path / "ref", tmp_path / "ref-w"
    ref_work.mkdir()
    # The reference runs alongside the elastic attempts (its own output dir and port): the
    # machine's cores are busy with process start-up (imports) either way.
    reference = Attempt(ref_out, ref_work, 1, REFERENCE_NODES, {})
    out, work = tmp_path / "out", tmp_path / "w"
    work.mkdir()
    combined: dict[int, list[int]] = {}
    try:
        # (ranks, SIGTERM once this step ended): stops inside the first and the second epoch
        plan = [(2, 2), (3, 5), (1, None)]
        for number, (ranks, sigterm_after) in enumerate(plan, start=1):
            extra = ("--step-sleep", "0.3") if sigterm_after else ()
            attempt = Attempt(out, work, number, ranks, ELASTIC_ENV, *extra)
            if sigterm_after is not None:
                attempt.wait_for(f"STEP {sigterm_after}\n")
                attempt.procs[0].send_signal(signal.SIGTERM)
            codes = attempt.wait()
            want = EXIT_PREEMPTED if sigterm_after is not None else 0
            assert codes == [want] * ranks, f"exit codes {codes}\n{attempt.tails()}"
            log = attempt.log()
            assert f"gradient_accumulation_steps {ACCUMULATION} -> {6 // ranks}" in log, log[-3000:]
            stopped = attempt.termination().step if sigterm_after else MAX_STEPS
            assert stopped is not None
            samples = attempt.step_samples()
            combined.update({s: rows for s, rows in samples.items() if s <= stopped})
    except BaseException:
        reference.kill()  # no process of this test outlives it
        raise
    assert reference.wait() == [0, 0], reference.tails()
    expected = reference.step_samples()
    assert sorted(expected) == list(range(1, MAX_STEPS + 1)), expected
    assert all(len(rows) == 12 for rows in expected.values()), "a global batch is 12 rows"
    for epoch in (range(1, 5), range(5, 9)):  # every row of each epoch exactly once
        assert sorted(r for s in epoch for r in expected[s]) == list(range(48))
    # Every optimizer step trained on exactly the reference's rows, whatever the size.
    assert combined == expected
    final = _weights(out / f"checkpoint-{MAX_STEPS}")
    for name, tensor in _weights(ref_out / f"checkpoint-{MAX_STEPS}").items():
        # Summation order differs across sizes; the training is the same up to rounding.
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
