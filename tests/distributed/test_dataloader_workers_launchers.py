"""A forwarded SIGTERM never kills a run through its DataLoader workers, under every launcher (issue
37; 2 processes per pod, gloo).

The pod's main process is the launcher and gets the kubelet's SIGTERM; the launcher forwards it
itself to each worker's whole process group (torchrun's ``os.killpg``: ``torchrun``, ``python -m
torch.distributed.run``, ``accelerate launch`` and ``trainer-runtime launch`` all use it), so every
DataLoader worker gets it too. Before the fix each worker case ended with ``DataLoader worker (pid
N) is killed by signal: Terminated`` in the training processes, no JIT checkpoint and a failed
attempt. Each case must now write its JIT checkpoint (complete, both ranks), exit as the table in
docs/operator.md says (75 for our launcher, torchrun's 1, accelerate's 143), leave no process
behind, and, once per launcher, resume to weights bit-identical with the uninterrupted run.

The matrix, chosen for a 2-core CI budget (each 2-rank case is a few toy steps, but starts and
tears down 2 ranks x 2 workers): ``trainer-runtime launch`` (what the operator wraps a plain
command in) gets the full matrix (``dataloader_num_workers`` 0, 2, 2 with persistent workers;
``pin_memory`` on, which pins only with an accelerator); every other launcher the worker cases that
differ from it the most, alternating persistent on and off, resumed once each (``python -m
torch.distributed.run`` only stopped: it is the code of ``torchrun``'s script);
``trainer-runtime launch --transformers`` runs a stock transformers script
(tests/runtime/hf_workers_script.py) with persistent workers, resumed and compared with its own
uninterrupted run. One process without
a launcher (and ``python -m trainer_runtime.hf.run``) is in
tests/runtime/test_dataloader_workers_sigterm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.conftest import MAX_STEPS, WORLD_SIZE, Reference, toy_args
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

# (case, resumed and compared with the uninterrupted run)
TOY_CASES = [
    (Case("trainer-runtime launch", 0), False),
    (Case("trainer-runtime launch", 2), False),
    (Case("trainer-runtime launch", 2, persistent=True), True),
    (Case("torchrun", 2), True),
    # torchrun's own code again (its console script runs torch.distributed.run:main)
    (Case("python -m torch.distributed.run", 2, persistent=True), False),
    (Case("accelerate launch", 2, persistent=True), True),
]


def _toy(case: Case, events: Path, *, step_sleep: float = 0.0) -> list[str]:
    program = ["-m", "trainer_runtime.toy", *toy_args(step_sleep=step_sleep)]
    return [*program, *case.loader_args(), "--events-file", str(events)]


@pytest.mark.parametrize(("case", "resume"), TOY_CASES, ids=[c.id for c, _ in TOY_CASES])
def test_toy_under_launcher(tmp_path: Path, reference: Reference, case: Case, resume: bool) -> None:
    out = tmp_path / "out"
    events = tmp_path / "events.jsonl"
    done = run_and_preempt(
        case,
        _toy(case, events, step_sleep=0.25),
        nproc=WORLD_SIZE,
        out=out,
        workdir=tmp_path,
        progressed=toy_progressed(events, 6),
    )
    assert 6 <= done.message.step < MAX_STEPS, done.message
    if not resume:
        return
    resume_and_compare(
        case,
        _toy(case, tmp_path / "events-a2.jsonl"),
        nproc=WORLD_SIZE,
        out=out,
        workdir=tmp_path,
        final_step=MAX_STEPS,
        reference=reference.final_checkpoint,
    )


HF_MAX_STEPS = 12
HF_CASE = Case("trainer-runtime launch --transformers", 2, persistent=True)


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stock script under our launcher, uninterrupted, with the case's loader options."""
    work = tmp_path_factory.mktemp("hf-launch-reference")
    env = operator_env(work / "out", work / "term.json", attempt=1, resume=False)
    cmd = command(HF_CASE.launcher, hf_program(work / "x", HF_CASE), nproc=WORLD_SIZE)
    pod = Pod(cmd, env, work)
    try:
        assert pod.wait() == 0, pod.tail()
    finally:
        pod.kill()
    return work / "out" / f"checkpoint-{HF_MAX_STEPS}"


def test_transformers_under_our_launcher(tmp_path: Path, hf_reference: Path) -> None:
    out = tmp_path / "out"
    done = run_and_preempt(
        HF_CASE,
        hf_program(tmp_path / "x", HF_CASE, "--step-sleep", "0.25"),
        nproc=WORLD_SIZE,
        out=out,
        workdir=tmp_path,
        progressed=hf_progressed(5),
    )
    assert 5 <= done.message.step < HF_MAX_STEPS, done.message
    resume_and_compare(
        HF_CASE,
        hf_program(tmp_path / "x", HF_CASE),
        nproc=WORLD_SIZE,
        out=out,
        workdir=tmp_path,
        final_step=HF_MAX_STEPS,
        reference=hf_reference,
    )
