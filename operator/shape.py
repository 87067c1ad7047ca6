"""Pure decisions about a pod of several training processes (``spec.numProcPerNode``).

A pod is one node's worth of processes. With more than one per pod the operator starts the
user's command through ``trainer-runtime launch`` (torchrun underneath), unless the command
already starts a launcher of its own; it renders torchrun's ``PET_*`` options as environment
(render.py) and a memory-backed ``/dev/shm`` sized for the processes.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence

from preemptible_operator.models import GPU_RESOURCE, TrainingJobSpec

__all__ = [
    "LAUNCH_COMMAND",
    "SHM_PER_PROCESS_GIB",
    "launcher_in",
    "pod_command",
    "procs_per_node",
    "shm_size_limit",
]

# What the operator puts in front of a command that does not start a launcher itself.
LAUNCH_COMMAND = ("trainer-runtime", "launch", "--")
# Default size limit of the memory-backed /dev/shm, per process of the pod: NCCL's shared-memory
# transport and DataLoader workers handing batches over live there (container runtimes give
# 64 MiB by default, which a multi-process pod outgrows). A limit, not a reservation: only what
# is written counts, against the container's memory limit.
SHM_PER_PROCESS_GIB = 2

_INTERPRETER = re.compile(r"^python(\d+(\.\d+)*)?$")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ash"})
# `python -m <module>` forms of the launchers, and what they are called in messages.
_LAUNCHER_MODULES = {
    "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torchrun",
    "accelerate.commands.launch": "accelerate launch",
}


def procs_per_node(spec: TrainingJobSpec) -> int:
    """Processes per pod: ``numProcPerNode``, ``auto`` = the ``nvidia.com/gpu`` count of
    ``resourcesPerNode`` (limits, else requests), 1 when unset. An ``auto`` whose count is not a
    positive integer gives 1 (a quantity the apiserver would refuse in the pod anyway)."""
    value = spec.num_proc_per_node
    if value is None:
        return 1
    if isinstance(value, int):
        return value
    resources = spec.resources_per_node
    for quantities in (resources.limits, resources.requests) if resources else ():
        if quantities and GPU_RESOURCE in quantities:
            raw = str(quantities[GPU_RESOURCE]).strip()
            return int(raw) if raw.isdigit() and int(raw) > 0 else 1
    return 1


def _module_after(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """For ``python [opts] -m module rest``: (module, rest)."""
    for i, token in enumerate(argv):
        if token == "-m" and i + 1 < len(argv):
            return argv[i + 1], list(argv[i + 2 :])
        if token.startswith("-m") and len(token) > 2:
            return token[2:], list(argv[i + 1 :])
        if not token.startswith("-"):
            return None  # a script: `python train.py`
    return None


def launcher_in(argv: Sequence[str]) -> str | None:
    """Which launcher the container's command line (command + args) starts, or None: torchrun
    (also ``python -m torch.distributed.run``/``launch``), ``accelerate launch`` (also
    ``python -m accelerate.commands.launch``), ``trainer-runtime launch`` (also ``python -m
    trainer_runtime.cli launch``), behind ``env VAR=...`` or as the first command of
    ``sh -c '...'`` (``exec`` allowed). A launcher hidden deeper (a script of its own) is not
    seen: name it in the command, or the pod would start a launcher inside a launcher."""
    argv = list(argv)
    if argv and os.path.basename(argv[0]) == "env":
        argv = argv[1:]
        while argv and (argv[0].startswith("-") or "=" in argv[0]):
            # env's options that take a value as the next word: -u NAME, -C DIR
            argv = argv[2:] if argv[0] in ("-u", "--unset", "-C", "--chdir") else argv[1:]
    if not argv:
        return None
    first = os.path.basename(argv[0])
    rest = argv[1:]
    if first == "torchrun":
        return "torchrun"
    if first == "accelerate" and rest[:1] == ["launch"]:
        return "accelerate launch"
    if first == "trainer-runtime" and rest[:1] == ["launch"]:
        return "trainer-runtime launch"
    if _INTERPRETER.match(first):
        found = _module_after(rest)
        if found is None:
            return None
        module, after = found
        if module in _LAUNCHER_MODULES:
            return _LAUNCHER_MODULES[module]
        if module == "trainer_runtime.cli" and after[:1] == ["launch"]:
            return "trainer-runtime launch"
        return None
    if first in _SHELLS and "-c" in rest:
        index = rest.index("-c")
        if index + 1 >= len(rest):
            return None
        try:
            words = shlex.split(rest[index + 1])
        except ValueError:
            return None
        if words[:1] == ["exec"]:
            words = words[1:]
        return launcher_in(words) if words and os.path.basename(words[0]) not in _SHELLS else None
    return None


def pod_command(spec: TrainingJobSpec) -> list[str] | None:
    """The training container's ``command``: the user's as it is with one process per pod or a
    command that starts its own launcher; else the user's behind ``trainer-runtime launch --``
    (its ``args`` follow unchanged). None: no command (the image's entrypoint), which the spec
    rules allow only with one process per pod."""
    if not spec.command:
        return None
    command = list(spec.command)
    if procs_per_node(spec) <= 1 or launcher_in([*command, *(spec.args or [])]) is not None:
        return command
    return [*LAUNCH_COMMAND, *command]


def shm_size_limit(spec: TrainingJobSpec) -> str | None:
    """The ``sizeLimit`` of the pod's memory-backed ``/dev/shm``, or None for none (one process
    per pod, as before; or ``shmSize: 0``)."""
    if spec.shm_size is not None:
        text = str(spec.shm_size).strip()
        return None if text in ("0", "") else text
    procs = procs_per_node(spec)
    if procs <= 1:
        return None
    return f"{SHM_PER_PROCESS_GIB * procs}Gi"
