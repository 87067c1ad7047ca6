"""Shared pieces of the SIGTERM x DataLoader-workers matrix (runtime and distributed tiers).

A pod's processes are started the way each launcher starts them (real processes, a new session
per pod) and stopped the way a pod is: the kubelet's SIGTERM to the pod's main process. A
launcher forwards it itself to each worker's whole process group (torchrun's ``os.killpg``, which
reaches the DataLoader workers too); a process without a launcher gets it on its whole group, as
dumb-init or ``kill -TERM -PGID`` deliver it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer_runtime.checkpoint.layout import CheckpointStore
from trainer_runtime.protocol import (
    ENV_ATTEMPT,
    ENV_GRACE_SECONDS,
    ENV_KILL_WAIT_SECONDS,
    ENV_OUTPUT_DIR,
    ENV_RESUME_FROM,
    ENV_TERMINATION_LOG,
    EXIT_PREEMPTED,
    TerminationMessage,
)
from trainer_runtime.testing import read_events, read_termination_message, weights_identical

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
HF_SCRIPT = HERE / "hf_workers_script.py"
GRACE = 60
TIMEOUT = 240.0

# The pod's exit code after a JIT stop, per docs/operator.md ("What each launcher mode gets").
EXIT_AFTER_JIT = {
    "none": EXIT_PREEMPTED,
    "hf.run": EXIT_PREEMPTED,
    "trainer-runtime launch": EXIT_PREEMPTED,
    "trainer-runtime launch --transformers": EXIT_PREEMPTED,
    "torchrun": 1,
    "python -m torch.distributed.run": 1,
    "accelerate launch": 143,
}
TRANSFORMERS_LAUNCHERS = ("hf.run", "trainer-runtime launch --transformers")


@dataclass(frozen=True)
class Case:
    launcher: str
    workers: int
    persistent: bool = False

    @property
    def id(self) -> str:
        return f"{self.launcher}-w{self.workers}{'-persistent' if self.persistent else ''}"

    @property
    def transformers(self) -> bool:
        return self.launcher in TRANSFORMERS_LAUNCHERS

    def loader_args(self) -> list[str]:
        args = ["--dataloader-num-workers", str(self.workers)]
        if self.persistent:
            args.append("--dataloader-persistent-workers")
        if not self.transformers:
            args += ["--dataloader-pin-memory", "true"]  # pinned only with an accelerator
        return args


def _console_script(name: str, entry: str) -> list[str]:
    """The console script ``name`` of this python's environment; where it is not installed next
    to ``sys.executable`` (an editable venv over a shared one), the same entry point (``module:
    function``) run by this python, as the script itself would."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return [str(here)]
    module, function = entry.split(":")
    code = f"import sys; from {module} import {function}; sys.argv[0] = {name!r}; "
    code += f"sys.exit({function}())"
    return [sys.executable, "-P", "-c", code]


def command(launcher: str, program: Sequence[str], *, nproc: int) -> list[str]:
    """The pod's command: ``program`` (``-m module args`` or ``script args``) under ``launcher``."""
    py = [sys.executable, "-P"]
    elastic = [f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if nproc > 1:
        elastic = ["--standalone", *elastic]
    if launcher == "none":
        return [*py, *program]
    if launcher == "hf.run":
        return [*py, "-m", "trainer_runtime.hf.run", *program]
    if launcher == "torchrun":
        return [*_console_script("torchrun", "torch.distributed.run:main"), *elastic, *program]
    if launcher == "python -m torch.distributed.run":
        return [*py, "-m", "torch.distributed.run", *elastic, *program]
    if launcher == "accelerate launch":
        head = [*_console_script("accelerate", "accelerate.commands.accelerate_cli:main"), "launch"]
        # docs/operator.md's flags for one pod (no --main_process_ip/port).
        flags = ["--multi_gpu", "--num_machines", "1", "--num_processes", str(nproc)]
        flags += ["--machine_rank", "0", "--max_restarts", "0"]
        return [*head, *flags, *program]
    if launcher.startswith("trainer-runtime launch"):
        launch = [*py, "-m", "trainer_runtime.cli", "launch", "--nproc-per-node", str(nproc)]
        if launcher.endswith("--transformers"):
            launch.append("--transformers")
        return [*launch, "--", *program]
    raise ValueError(launcher)


def operator_env(
    out: Path, term: Path, *, attempt: int, resume: bool, extra: Mapping[str, str] = ()
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTIBLE_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    env.update(
        {
            ENV_OUTPUT_DIR: str(out),
            ENV_ATTEMPT: str(attempt),
            ENV_RESUME_FROM: "latest" if resume else "",
            ENV_TERMINATION_LOG: str(term),
            ENV_KILL_WAIT_SECONDS: "0.2",
            ENV_GRACE_SECONDS: str(GRACE),
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(GRACE),  # as the operator sets it
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra)
    return env


class Pod:
    """One pod's main process (a new session, as a container's), its log and its output."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.log_path = workdir / "log.txt"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                list(cmd),
                cwd=workdir,  # not the repository: its operator/ would shadow the stdlib's
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 4000) -> str:
        return f"--- {self.log_path} ---\n{self.log()[-n:]}"

    def wait_until(self, ready: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before {what}\n{self.tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {what} within {timeout} s\n{self.tail()}")
            time.sleep(0.05)

    def sigterm(self, *, whole_group: bool) -> None:
        """The kubelet's SIGTERM to the main process; ``whole_group``: to its process group."""
        if whole_group:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            os.kill(self.proc.pid, signal.SIGTERM)

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s\n{self.tail()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            with_group = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                with_group = False
            if not with_group:
                self.proc.kill()
            self.proc.wait()


def processes_mentioning(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker`` (a DataLoader worker is a fork of
    its training process, so it carries the same command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def assert_nothing_left(marker: str, pod: Pod, timeout: float = 15.0) -> None:
    """Every process of the pod (training processes and their DataLoader workers) has ended."""
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes still alive after the pod ended: {left}\n{pod.tail()}"


@dataclass
class Interrupted:
    code: int
    message: TerminationMessage
    pod: Pod


def run_and_preempt(
    case: Case,
    program: Sequence[str],
    *,
    nproc: int,
    out: Path,
    workdir: Path,
    progressed: Callable[[Pod], bool],
) -> Interrupted:
    """Start the pod, SIGTERM it once ``progressed`` says training is under way, and check the
    JIT checkpoint, the exit code of the docs' table and that no process is left."""
    term = workdir / "termination-a1.json"
    env = operator_env(out, term, attempt=1, resume=False)
    pod = Pod(command(case.launcher, program, nproc=nproc), env, workdir / "a1")
    try:
        pod.wait_until(lambda: progressed(pod), "training progress")
        pod.sigterm(whole_group=case.launcher in ("none", "hf.run"))
        code = pod.wait()
    finally:
        pod.kill()
    log = pod.log()
    assert "killed by signal" not in log, f"a DataLoader worker died by the SIGTERM\n{pod.tail()}"
    assert code == EXIT_AFTER_JIT[case.launcher], (
        f"{case.launcher} exited {code}, docs say {EXIT_AFTER_JIT[case.launcher]}\n{pod.tail()}"
    )
    msg = read_termination_message(term.read_text() if term.exists() else None)
    assert msg is not None, f"no termination message\n{pod.tail()}"
    assert msg.reason == "preempted" and msg.complete, f"{msg}\n{pod.tail()}"
    assert msg.checkpoint and msg.checkpoint.endswith(f"checkpoint-{msg.step}"), msg
    info = CheckpointStore(str(out)).inspect(f"checkpoint-{msg.step}")
    assert info.complete, f"JIT checkpoint-{msg.step} is not complete: {info.reason}"
    assert info.manifest is not None and info.manifest["world_size"] == nproc, info.manifest
    assert_nothing_left(str(workdir), pod)
    return Interrupted(code, msg, pod)


def resume_and_compare(
    case: Case,
    program: Sequence[str],
    *,
    nproc: int,
    out: Path,
    workdir: Path,
    final_step: int,
    reference: Path,
) -> None:
    """Attempt 2 from the newest complete checkpoint, to the end; the final weights must be
    bit-identical to the uninterrupted run's (``reference``: its final checkpoint)."""
    term = workdir / "termination-a2.json"
    env = operator_env(out, term, attempt=2, resume=True)
    pod = Pod(command(case.launcher, program, nproc=nproc), env, workdir / "a2")
    try:
        code = pod.wait()
    finally:
        pod.kill()
    assert code == 0, f"resumed run exited {code}\n{pod.tail()}"
    final = out / f"checkpoint-{final_step}"
    same, detail = weights_identical(final, reference)
    assert same, f"{final} differs from the uninterrupted run: {detail}"
    assert_nothing_left(str(workdir), pod)


def toy_progressed(events: Path, step: int) -> Callable[[Pod], bool]:
    def ready(_pod: Pod) -> bool:
        return any(e["event"] == "step_begin" and e["step"] >= step for e in read_events(events))

    return ready


def hf_progressed(step: int) -> Callable[[Pod], bool]:
    def ready(pod: Pod) -> bool:
        return f"STEP {step}\n" in pod.log()

    return ready


def hf_program(out_arg: Path, case: Case, *extra: str) -> list[str]:
    return [str(HF_SCRIPT), "--output-dir", str(out_arg), *case.loader_args(), *extra]
