"""One checkpoint copy per node (``save_on_each_node=True``): which node a rank is on, the writer
options, and which step every node resumes from.

For nodes without shared storage: the main process of every node (local rank 0) writes a complete,
self-contained copy of each checkpoint on its node's own disk (see
:class:`trainer_runtime.checkpoint.io.CheckpointWriter`, ``each_node``). On resume every rank looks
at its own node's copies; the ranks then agree on one step through a collective: the newest step
complete on *every* node (a node whose copy of a newer step is missing or incomplete holds the
others back), or a clear error naming each node's complete steps when no step is complete on all
of them.

The decision functions are pure and torch-free; :func:`gather_objects` and
:func:`resolve_resume` need an initialised process group.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from trainer_runtime.checkpoint.layout import (
    SENTINEL_NAME,
    CheckpointInfo,
    CheckpointStore,
    attempt_from_env,
    checkpoint_name,
)
from trainer_runtime.checkpoint.storage import Storage
from trainer_runtime.errors import ConfigurationError, ResumeError
from trainer_runtime.protocol import ENV_RESUME_FROM

__all__ = [
    "NodeReport",
    "check_requested_checkpoint",
    "check_storage_not_shared",
    "choose_latest_step",
    "each_node_active",
    "gather_objects",
    "is_checkpoint_writer",
    "newer_than_requested",
    "node_label",
    "resolve_resume",
    "writer_options",
]

logger = logging.getLogger(__name__)

# torchrun sets GROUP_RANK (its node rank) for every worker; the operator sets NODE_RANK per pod.
_NODE_ENV = ("GROUP_RANK", "NODE_RANK")


def node_label(env: Mapping[str, str] | None = None) -> str:
    """This process's node: $GROUP_RANK (torchrun), else $NODE_RANK, else the host name."""
    env = os.environ if env is None else env
    for name in _NODE_ENV:
        value = (env.get(name) or "").strip()
        if value:
            return value
    return socket.gethostname()


def _local_rank(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    raw = (env.get("LOCAL_RANK") or "0").strip()
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"LOCAL_RANK={raw!r} is not an integer") from None


def each_node_active(args: Any) -> bool:
    """save_on_each_node is set and there are several ranks (one rank: the ordinary protocol)."""
    from trainer_runtime.distributed import collectives

    return bool(getattr(args, "save_on_each_node", False)) and collectives.is_distributed()


def is_checkpoint_writer(args: Any, *, is_main_process: bool, is_local_main_process: bool) -> bool:
    """Whether this process writes checkpoints (and rotates them) on its storage: rank 0, or
    every node's main process with save_on_each_node (the Hugging Face meaning)."""
    if getattr(args, "save_on_each_node", False):
        return is_local_main_process
    return is_main_process


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` in one process."""
    import torch.distributed as dist

    from trainer_runtime.distributed import collectives

    if not collectives.is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def writer_options(args: Any) -> dict[str, Any]:
    """Extra keyword arguments for CheckpointWriter: one copy per node under save_on_each_node."""
    # (save_on_each_node with fsdp is refused when the arguments are built: ddp_args)
    if not each_node_active(args):
        return {}
    return {
        "each_node": True,
        "local_rank": _local_rank(),
        "node": node_label(),
        "gather": gather_objects,
    }


_PROBE_PREFIX = ".save-on-each-node-probe-"


def check_storage_not_shared(args: Any, local_rank: int) -> None:
    """Before training (a collective: call it on every rank): refuse save_on_each_node when the
    nodes' output dirs are one shared storage, where their copies would collide.

    Every node's main process writes a probe file into its output dir; the probes' names are
    all-gathered, and a node that sees another node's probe shares its storage.
    """
    if not each_node_active(args):
        return
    output_dir = str(args.output_dir)
    storage = Storage(output_dir)
    probe: str | None = None
    error: str | None = None
    if local_rank == 0:
        try:
            storage.makedirs("")
            probe = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
            storage.write_json(probe, {"node": node_label(), "pid": os.getpid()})
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    probes = gather_objects((node_label(), probe, error))
    seen: list[str] = []
    if probe is not None:
        seen = [n for n, p, _ in probes if p is not None and p != probe and storage.exists(p)]
    found = gather_objects((node_label(), seen))
    if probe is not None:
        storage.remove(probe)
    failed = [f"node {n}: {e}" for n, _, e in probes if e is not None]
    if failed:
        detail = "; ".join(failed)
        raise ConfigurationError(
            f"save_on_each_node=True: cannot write to output_dir {output_dir!r} ({detail})"
        )
    shared = sorted({(n, o) for n, others in found for o in others}, key=lambda p: _order(p[0]))
    if shared:
        pairs = ", ".join(f"node {n} sees node {o}'s files" for n, o in shared)
        raise ConfigurationError(
            f"save_on_each_node=True, but the nodes share the storage of output_dir "
            f"{output_dir!r} ({pairs}): their copies of each checkpoint would overwrite each "
            "other; use save_on_each_node=False with shared storage (one copy, committed by "
            "rank 0), or give each node its own disk"
        )


# -- the resume decision (pure) -----------------------------------------------------------------
@dataclass(frozen=True)
class NodeReport:
    """What one rank found on its node: the complete steps, and the requested checkpoint."""

    node: str
    complete_steps: tuple[int, ...]
    # for an explicit checkpoint path: (complete, step, reason) on this node
    requested: tuple[bool, int, str | None] | None = None


def _order(node: str) -> tuple[int, int, str]:
    return (0, int(node), "") if node.isdigit() else (1, 0, node)


def _by_node(reports: Collection[NodeReport]) -> dict[str, set[int]]:
    """Complete steps per node; ranks of one node that disagree count only what all of them see."""
    steps: dict[str, set[int]] = {}
    for r in reports:
        mine = set(r.complete_steps)
        steps[r.node] = steps[r.node] & mine if r.node in steps else mine
    return dict(sorted(steps.items(), key=lambda kv: _order(kv[0])))


def _describe(steps: Mapping[str, Collection[int]]) -> str:
    return "; ".join(
        f"node {node}: {', '.join(map(str, sorted(s))) if s else 'none'}"
        for node, s in steps.items()
    )


def choose_latest_step(reports: Collection[NodeReport]) -> tuple[int | None, str | None]:
    """The newest step complete on every node, and a note when a node has a newer one.

    Returns ``(None, None)`` when no node has any complete checkpoint (nothing to resume). Raises
    ResumeError, naming each node's complete steps, when nodes have checkpoints but no step is
    complete on all of them.
    """
    steps = _by_node(reports)
    if not any(steps.values()):
        return None, None
    common = set.intersection(*steps.values()) if steps else set()
    if not common:
        raise ResumeError(
            "save_on_each_node: no checkpoint step is complete on every node (complete steps by "
            f"node: {_describe(steps)}); every node resumes from its own copy, so copy a complete "
            "checkpoint-<step> directory to the output_dir of the nodes that lack it, or train "
            f"without resuming (resume_from_checkpoint=False, {ENV_RESUME_FROM} empty)"
        )
    step = max(common)
    newest = max(max(s) for s in steps.values())
    if newest == step:
        return step, None
    note = (
        f"save_on_each_node: checkpoint-{newest} is not complete on every node (complete steps "
        f"by node: {_describe(steps)}): every node resumes from checkpoint-{step}, the newest "
        "step complete on all of them"
    )
    return step, note


def newer_than_requested(reports: Collection[NodeReport]) -> int | None:
    """The newest step complete on every node when it is newer than the requested checkpoint's
    step (every node's, the same), else None; pure."""
    requested = {r.requested[1] for r in reports if r.requested is not None}
    if len(requested) != 1 or min(requested) < 0:
        return None
    try:
        step, _ = choose_latest_step(reports)
    except ResumeError:
        return None
    return step if step is not None and step > requested.pop() else None


def check_requested_checkpoint(path: str, reports: Collection[NodeReport]) -> int:
    """The step of an explicitly requested checkpoint, which must be complete (and the same step)
    on every node; ResumeError naming each node's state otherwise."""
    per_node: dict[str, tuple[bool, int, str | None]] = {}
    for r in reports:
        assert r.requested is not None, "every rank reports the requested checkpoint"
        ok, step, reason = r.requested
        seen = per_node.get(r.node)
        if seen is None or (seen[0] and not ok):
            per_node[r.node] = (ok, step, reason)
    ordered = dict(sorted(per_node.items(), key=lambda kv: _order(kv[0])))
    bad = {n: v for n, v in ordered.items() if not v[0]}
    steps = {v[1] for v in ordered.values()}
    if bad or len(steps) != 1:
        detail = "; ".join(
            f"node {n}: " + (f"complete, step {s}" if ok else f"not usable ({why})")
            for n, (ok, s, why) in ordered.items()
        )
        raise ResumeError(
            f"cannot resume from {path} with save_on_each_node: every node needs a complete copy "
            f"of the same step ({detail}); copy the checkpoint directory to the nodes that lack "
            "it, or resume from 'latest' (the newest step complete on every node)"
        )
    return steps.pop()


# -- the resume collective -------------------------------------------------------------------
def _report(store: CheckpointStore, path: str | None, below: int | None = None) -> NodeReport:
    infos = store.list()
    complete = tuple(i.step for i in infos if i.complete and (below is None or i.step < below))
    requested: tuple[bool, int, str | None] | None = None
    if path is not None:
        info = store.inspect(path)
        requested = (info.complete, info.step, info.reason or (None if info.complete else "?"))
    return NodeReport(node_label(), complete, requested)


def _set_aside_newer(store: CheckpointStore, step: int, reason: str) -> list[str]:
    """Mark this node's complete checkpoints newer than ``step`` incomplete (a sentinel, nothing
    deleted): resuming from an older step abandons them, and a stale newer checkpoint must
    neither be resumed later nor make rotation keep it instead of the new ones."""
    marked = []
    for info in store.list():
        if info.step > step and info.complete:
            store.storage.write_json(
                f"{info.name}/{SENTINEL_NAME}",
                {"set_aside": True, "reason": reason, "attempt": attempt_from_env()},
            )
            marked.append(info.path)
    if marked:
        store.storage.fsync_dir("")
    return marked


def resolve_resume(
    output_dir: str,
    resume: bool | str,
    *,
    from_env: bool,
    local_rank: int,
    below: int | None = None,
) -> CheckpointInfo | None:
    """The checkpoint this rank resumes from, agreed by every rank (a collective: call it on all).

    ``resume``: True for the newest complete checkpoint, or a path (resolved on each node). Each
    rank reads its own node's ``output_dir``; all ranks get the same step or the same error.
    ``below``: only steps lower than this count (the fallback from a corrupt checkpoint).
    """
    store = CheckpointStore(output_dir)
    path = None if resume is True else str(resume)
    report = _report(store, path, below)
    reports = [NodeReport(*r) for r in gather_objects(tuple(_fields(report)))]
    if path is not None and from_env and below is None:
        newer = newer_than_requested(reports)
        if newer is not None:
            # a path from the operator is the least a resume may start from
            logger.warning(
                "%s=%s, but checkpoint-%d is complete on every node and newer: resuming from it",
                ENV_RESUME_FROM,
                path,
                newer,
            )
            path = None
    if path is not None:
        check_requested_checkpoint(path, reports)
        info = store.inspect(path)
        logger.info("save_on_each_node: every node resumes from its copy of %s", info.name)
        return info
    step_or_none, note = choose_latest_step(reports)
    if step_or_none is None:
        if from_env:
            logger.info(
                "%s=latest but no node has a complete checkpoint in %s: starting from scratch",
                ENV_RESUME_FROM,
                output_dir,
            )
            return None
        raise ResumeError(
            f"resume_from_checkpoint=True but no node has a complete checkpoint in {output_dir}; "
            "train without resume_from_checkpoint or pass a checkpoint path"
        )
    if note is not None:
        logger.warning("%s", note)
        if local_rank == 0:
            for marked in _set_aside_newer(store, step_or_none, note):
                logger.warning("set aside %s (now incomplete: a sentinel was added)", marked)
    gather_objects(None)  # nobody loads before every node set its newer copies aside
    info = store.inspect(checkpoint_name(step_or_none))
    logger.info("save_on_each_node: resuming from this node's copy %s", info.path)
    return info


def _fields(report: NodeReport) -> tuple[Any, ...]:
    # plain tuples travel through pickle without importing this module's class on the receiver
    return (report.node, report.complete_steps, report.requested)
