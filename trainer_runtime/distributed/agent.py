"""The torchrun agent of ``trainer-runtime launch``: torchrun's own CLI, plus a record of how
each worker ended.

``python -m trainer_runtime.distributed.agent [torchrun options] script [args]`` parses its
arguments with ``torch.distributed.run.parse_args`` and runs ``torch.distributed.run.run`` (the
elastic launch behind the ``torchrun`` command), so every option and ``PET_*`` variable means
what it means to torchrun. What torchrun itself only logs is written, structured, to
``$PREEMPTIBLE_TERMINATION_DIR/agent.json`` for the launcher (``launch.pod_end``):

- each worker's local rank, global rank and exit code (128 + N after signal N);
- ``ordered``: whether the list is in the order the workers ended. After a worker failure torchrun
  raises ``ChildFailedError``, whose ``failures`` are captured first failure first (the root
  cause, then the workers torchrun stopped); signalled itself it raises ``SignalException``, which
  says nothing about the workers, so the exit codes are read from the agent's process handles
  when it shuts its workers down (see :func:`install_recorder`), in local-rank order.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from trainer_runtime.distributed.launch import AGENT_ENDS_FILE
from trainer_runtime.protocol import ENV_TERMINATION_DIR

__all__ = ["install_recorder", "main", "ordered_ends", "shell_code"]


def shell_code(returncode: int | None) -> int | None:
    """A process's exit status as a shell shows it: a negative ``returncode`` (killed by signal
    N) becomes 128 + N."""
    if returncode is None:
        return None
    return returncode if returncode >= 0 else 128 - returncode


def ordered_ends(
    handles: dict[int, dict[str, Any]], failures: Sequence[tuple[int, int | None, float]]
) -> list[dict[str, Any]]:
    """Pure: the workers' ends, first ended first. ``handles``: local rank -> {local_rank, rank,
    exit_code} read from the process handles; ``failures``: (local rank, exit code, timestamp)
    of torchrun's ``ChildFailedError`` in its own order (capture order; timestamps have one
    second's resolution, so ties keep that order). Workers without a failure (exit 0, or no
    failure report) follow in local-rank order."""
    ranked = sorted(enumerate(failures), key=lambda item: (item[1][2], item[0]))
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for _, (local, code, _) in ranked:
        entry = dict(handles.get(local) or {"local_rank": local, "rank": None})
        entry["exit_code"] = shell_code(code)
        out.append(entry)
        seen.add(local)
    out += [dict(handles[local]) for local in sorted(handles) if local not in seen]
    return out


def install_recorder() -> dict[int, dict[str, Any]]:
    """Make torchrun's launcher use an agent that, whenever it shuts its workers down (after a
    failure, on a signal, at the end), records each worker's exit code from its process handle.

    This reaches into torchrun (``launcher.api.LocalElasticAgent``, ``_shutdown``, the
    subprocess context's handles: torch 2.15); should those change, nothing is recorded and the
    launcher falls back to ``ChildFailedError``'s failures and the workers' own messages."""
    handles: dict[int, dict[str, Any]] = {}
    try:
        from torch.distributed.launcher import api as launcher_api

        base = launcher_api.LocalElasticAgent
    except (ImportError, AttributeError):
        return handles

    class RecordingAgent(base):  # type: ignore[misc, valid-type]
        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            try:
                super()._shutdown(death_sig, timeout)
            finally:
                _record(self, handles)

    launcher_api.LocalElasticAgent = RecordingAgent
    return handles


def _record(agent: Any, handles: dict[int, dict[str, Any]]) -> None:
    context = getattr(agent, "_pcontext", None)
    procs = getattr(context, "subprocess_handlers", None) or {}
    group = getattr(agent, "_worker_group", None)
    for worker in getattr(group, "workers", None) or []:
        handler = procs.get(worker.local_rank)
        proc = getattr(handler, "proc", None)
        code = proc.poll() if proc is not None else None
        rank = getattr(worker, "global_rank", None)
        handles[worker.local_rank] = {
            "local_rank": worker.local_rank,
            "rank": rank if isinstance(rank, int) and rank >= 0 else None,
            "exit_code": shell_code(code),
        }


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    handles = install_recorder()
    failures: list[tuple[int, int | None, float]] = []
    record: dict[str, Any] = {"agent": "ok"}
    code = 0
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        code = 1
        record["agent"] = "workers_failed"
        failures = [(f.local_rank, f.exitcode, float(f.timestamp)) for f in exc.failures.values()]
    except SignalException as exc:
        code = 128 + int(exc.sigval)
        record["agent"] = f"signalled ({signal.Signals(exc.sigval).name})"
    except Exception as exc:  # rendezvous, bad options: the launcher reports it
        code = 1
        record["agent"] = "error"
        record["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        traceback.print_exc()
    # The workers are gone; a termination signal now (the pod deleted after another pod's end)
    # must not kill this process before the record is written: torchrun restored the default
    # handlers when it shut its workers down.
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    record["code"] = code  # the launcher's, should this process's own exit hang after this
    record["ordered"] = bool(failures)
    record["workers"] = ordered_ends(handles, failures)
    if handles:
        record["nproc"] = len(handles)
    directory = os.environ.get(ENV_TERMINATION_DIR)
    if directory:
        with open(os.path.join(directory, AGENT_ENDS_FILE), "w", encoding="utf-8") as fh:
            json.dump(record, fh)
    return code


if __name__ == "__main__":
    sys.exit(main())
