"""A SIGTERM on the whole process group never kills a run through its DataLoader workers (issue 37,
one process per pod; the launchers of several processes are in
tests/distributed/test_dataloader_workers_launchers.py).

A process without a launcher, stopped the way dumb-init or ``kill -TERM -PGID`` stop it: the
SIGTERM reaches the training process and every DataLoader worker at once. torch's worker handler
lets a worker die by a SIGTERM its parent did not send, and the training process's SIGCHLD handler
then raised ``DataLoader worker (pid N) is killed by signal: Terminated``: exit 1, no JIT
checkpoint. Now each case must write its JIT checkpoint, exit 75, leave no process behind, and
resume to weights bit-identical with the uninterrupted run.

The matrix, chosen for a 2-core CI budget: our Trainer (the toy) gets the full matrix
(``dataloader_num_workers`` 0, 2, 2 with persistent workers; ``pin_memory`` on, which pins only
with an accelerator), the persistent case resumed and compared (workers or not, our Trainer's
batches and weights are the same: one uninterrupted reference serves); a stock transformers script
under ``python -m trainer_runtime.hf.run`` gets the two worker variants, the persistent one resumed
and compared with an uninterrupted run of the same script and options. Workers 0 is the control (it
passed before the fix); the worker cases failed before it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.conftest import MAX_STEPS, Reference, toy_args
from tests.runtime.worker_matrix import (
    Case,
    Pod,
    command,
    hf_program,
    hf_progressed,
    operator_env,
    resume_and_compare,
    run_and_preempt,
    toy_progressed,
)

pytestmark = [pytest.mark.runtime, pytest.mark.timeout(600)]

TOY_CASES = [Case("none", 0), Case("none", 2), Case("none", 2, persistent=True)]


@pytest.mark.parametrize("case", TOY_CASES, ids=lambda c: c.id)
def test_toy_group_sigterm(tmp_path: Path, reference: Reference, case: Case) -> None:
    out = tmp_path / "out"
    events = tmp_path / "events.jsonl"
    program = ["-m", "trainer_runtime.toy", *toy_args(step_sleep=0.25), *case.loader_args()]
    program += ["--events-file", str(events)]
    done = run_and_preempt(
        case, program, nproc=1, out=out, workdir=tmp_path, progressed=toy_progressed(events, 6)
    )
    assert 6 <= done.message.step < MAX_STEPS, done.message
    if not case.persistent:
        return  # one resume per launcher (CI time): the persistent case's
    resumed = ["-m", "trainer_runtime.toy", *toy_args(), *case.loader_args()]
    resumed += ["--events-file", str(tmp_path / "events-a2.jsonl")]
    resume_and_compare(
        case,
        resumed,
        nproc=1,
        out=out,
        workdir=tmp_path,
        final_step=MAX_STEPS,
        reference=reference.final_checkpoint,
    )


HF_MAX_STEPS = 12


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stock script under the integration, uninterrupted, with the resumed case's loader
    options."""
    work = tmp_path_factory.mktemp("hf-workers-reference")
    case = Case("hf.run", 2, persistent=True)
    env = operator_env(work / "out", work / "term.json", attempt=1, resume=False)
    pod = Pod(command(case.launcher, hf_program(work / "x", case), nproc=1), env, work)
    try:
        assert pod.wait() == 0, pod.tail()
    finally:
        pod.kill()
    return work / "out" / f"checkpoint-{HF_MAX_STEPS}"


@pytest.mark.parametrize(
    "case", [Case("hf.run", 2), Case("hf.run", 2, persistent=True)], ids=lambda c: c.id
)
def test_transformers_group_sigterm(tmp_path: Path, hf_reference: Path, case: Case) -> None:
    out = tmp_path / "out"
    program = hf_program(tmp_path / "x", case, "--step-sleep", "0.25")
    done = run_and_preempt(
        case, program, nproc=1, out=out, workdir=tmp_path, progressed=hf_progressed(5)
    )
    assert 5 <= done.message.step < HF_MAX_STEPS, done.message
    if not case.persistent:
        return  # one resume per launcher (CI time): the persistent case's
    resume_and_compare(
        case,
        hf_program(tmp_path / "x", case),
        nproc=1,
        out=out,
        workdir=tmp_path,
        final_step=HF_MAX_STEPS,
        reference=hf_reference,
    )
