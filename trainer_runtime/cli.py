"""``trainer-runtime``: inspect checkpoints and compute grace periods from the command line.

Subcommands are registered in ``SUBCOMMANDS`` (name -> function adding its parser); to add one,
write ``def _add_x(sub) -> None`` that calls ``sub.add_parser(...)`` and
``set_defaults(func=handler)`` where ``handler(args) -> int`` is the exit code, then list it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from trainer_runtime.checkpoint.layout import (
    RUNTIME_STATE_NAME,
    TRAINER_STATE_NAME,
    CheckpointInfo,
    CheckpointStore,
)
from trainer_runtime.errors import TrainerRuntimeError
from trainer_runtime.grace import GracePolicy, recommend_grace
from trainer_runtime.protocol import STOP_POLICIES, SaveTimings, StepTimings

__all__ = ["SUBCOMMANDS", "build_parser", "human_size", "main"]

# key of trainer_state.json that held the runtime's measurements before they moved to their own
# file (preemptible_state.json); still read from older checkpoints
STATE_KEY = "preemptible"


class CliError(Exception):
    """A user-facing error: printed as one line on stderr, exit code 1."""


def human_size(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    raw = getattr(args, "storage_options", None)
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise CliError(
            f"--storage-options {raw!r} is not JSON: pass an object, e.g. '{{\"anon\": true}}'"
        ) from exc
    if not isinstance(value, dict):
        raise CliError(f"--storage-options {raw!r} is not a JSON object")
    return value


def _open_store(args: argparse.Namespace) -> CheckpointStore:
    store = CheckpointStore(args.output_dir, _storage_options(args))
    if not store.storage.exists(""):
        raise CliError(f"output dir {args.output_dir!r} does not exist")
    return store


# -- inspect ----------------------------------------------------------------------------------
def _info_dict(info: CheckpointInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "path": info.path,
        "step": info.step,
        "complete": info.complete,
        "reason": info.reason,
        "size_bytes": info.size_bytes,
        "size": human_size(info.size_bytes),
        "attempt": info.attempt,
        "save_seconds": info.save_seconds,
        "created_at": info.created_at,
        "world_size": (info.manifest or {}).get("world_size"),
        # save_on_each_node: which node's copy this is ({"node", "nodes", "writer_rank"})
        "node_copy": (info.manifest or {}).get("node_copy"),
        # fsdp: {"format": "fsdp-dcp/1", "metadata": ".metadata", "optimizer": bool}
        "sharding": (info.manifest or {}).get("sharding"),
    }


def _cmd_inspect(args: argparse.Namespace) -> int:
    store = _open_store(args)
    infos = store.list()
    latest = next((i for i in reversed(infos) if i.complete), None)
    if args.json:
        doc = {
            "output_dir": args.output_dir,
            "latest_complete": latest.path if latest else None,
            "checkpoints": [_info_dict(i) for i in infos],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"output dir: {args.output_dir}")
    if not infos:
        print("no checkpoints")
        return 0
    rows = [("STEP", "CHECKPOINT", "STATUS", "SIZE", "ATTEMPT", "SAVE_S")]
    for i in infos:
        status = "complete" if i.complete else f"INCOMPLETE: {i.reason}"
        rows.append(
            (
                str(i.step),
                i.name,
                status,
                human_size(i.size_bytes),
                "-" if i.attempt is None else str(i.attempt),
                "-" if i.save_seconds is None else f"{i.save_seconds:.3f}",
            )
        )
    # status last so a long reason does not push the other columns around
    order = (0, 1, 3, 4, 5, 2)
    widths = [max(len(r[c]) for r in rows) for c in range(6)]
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) if c != 2 else r[c] for c in order).rstrip())
    print(f"newest complete: {latest.name if latest else 'none'}")
    sharding = (latest.manifest or {}).get("sharding") if latest else None
    if isinstance(sharding, dict):
        world = (latest.manifest or {}).get("world_size") if latest else None
        print(
            f"sharded: {sharding.get('format')} (FSDP model"
            f"{' and optimizer' if sharding.get('optimizer', True) else ''} shards of {world} "
            "ranks); resume it with fsdp set, at any number of ranks"
        )
    copy = (latest.manifest or {}).get("node_copy") if latest else None
    if isinstance(copy, dict):
        print(
            f"node copy: this is node {copy.get('node')}'s copy (save_on_each_node; nodes "
            f"{', '.join(map(str, copy.get('nodes') or []))}): each node holds its own, "
            "inspect the output dir on every node"
        )
    return 0


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="list the checkpoints of an output dir and say which are complete",
        description="List every checkpoint-<step> under OUTPUT_DIR: step, complete or why not, "
        "size, attempt and save seconds.",
    )
    p.add_argument("output_dir", help="output dir: a path or fsspec URL (file://, s3://, ...)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--storage-options", help="fsspec storage options as a JSON object")
    p.set_defaults(func=_cmd_inspect)


# -- grace ------------------------------------------------------------------------------------
def _runtime_record(info: CheckpointInfo, store: CheckpointStore) -> dict[str, Any]:
    """The runtime's record of a checkpoint: preemptible_state.json, or (checkpoints of earlier
    versions) the ``preemptible`` key of trainer_state.json."""
    own = f"{info.name}/{RUNTIME_STATE_NAME}"
    if store.storage.exists(own):
        block = store.storage.read_json(own)
        if not isinstance(block, dict):
            raise CliError(f"{info.path}/{RUNTIME_STATE_NAME} is not a JSON object")
        return block
    rel = f"{info.name}/{TRAINER_STATE_NAME}"
    if not store.storage.exists(rel):
        raise CliError(
            f"{info.path} has no {TRAINER_STATE_NAME} (nor {RUNTIME_STATE_NAME}): no timings "
            "recorded"
        )
    state = store.storage.read_json(rel)
    block = state.get(STATE_KEY) if isinstance(state, dict) else None
    if not isinstance(block, dict):
        raise CliError(
            f"{info.path} has no {RUNTIME_STATE_NAME} and its {TRAINER_STATE_NAME} has no "
            f"{STATE_KEY!r} timings (written by a trainer without the preemptible runtime?)"
        )
    return block


def _timings(info: CheckpointInfo, store: CheckpointStore) -> dict[str, Any]:
    block = _runtime_record(info, store)
    step = StepTimings.model_validate(block.get("step_seconds") or {})
    save = SaveTimings.model_validate(block.get("save_seconds") or {})
    exits = [float(x) for x in (block.get("sigterm_to_exit_seconds") or []) if x is not None]
    save_max = save.max
    # the manifest knows how long this very checkpoint took, which trainer_state.json cannot
    if info.save_seconds is not None:
        save_max = max(save_max or 0.0, info.save_seconds)
    if step.max is None and save_max is None and not exits:
        raise CliError(f"{info.path}/{TRAINER_STATE_NAME} records no step, save or exit timings")
    micro = StepTimings.model_validate(block.get("micro_batch_seconds") or {})
    return {
        "step_max": step.max,
        "save_max": save_max,
        "sigterm_to_exit": exits,
        "micro_batch_max": micro.max,
    }


def _cmd_grace(args: argparse.Namespace) -> int:
    store = _open_store(args)
    info = store.latest_complete()
    if info is None:
        raise CliError(f"no complete checkpoint under {args.output_dir}: nothing measured yet")
    t = _timings(info, store)
    defaults = GracePolicy()
    try:
        policy = GracePolicy(
            initial_seconds=defaults.initial_seconds,
            minimum=args.min if args.min is not None else defaults.minimum,
            maximum=args.max if args.max is not None else defaults.maximum,
            headroom=args.headroom if args.headroom is not None else defaults.headroom,
            kill_wait=args.kill_wait if args.kill_wait is not None else defaults.kill_wait,
            exit_margin=args.exit_margin if args.exit_margin is not None else defaults.exit_margin,
            stop_policy=args.stop_policy,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    rec = recommend_grace(
        t["step_max"],
        t["save_max"],
        t["sigterm_to_exit"] or None,
        policy,
        micro_batch_max=t["micro_batch_max"],
    )
    if args.json:
        doc = {
            "terminationGracePeriodSeconds": rec.seconds,
            "required_seconds": rec.required_seconds,
            "capped": rec.capped,
            "reason": rec.reason,
            "checkpoint": info.path,
            "step": info.step,
            "inputs": {**rec.inputs, "sigterm_to_exit_seconds": t["sigterm_to_exit"]},
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"terminationGracePeriodSeconds: {rec.seconds}")
    print(f"  from: {info.path} (step {info.step})")
    print(f"  reason: {rec.reason}")
    for key, value in rec.inputs.items():
        print(f"  {key}: {'-' if value is None else value}")
    if rec.capped:
        print(f"  WARNING: {rec.required_seconds} s needed, capped at --max {policy.maximum}")
    return 0


def _add_grace(sub: Any) -> None:
    p = sub.add_parser(
        "grace",
        help="recommend terminationGracePeriodSeconds from measured step and save times",
        description="Compute ceil(kill_wait + (1+headroom)*(step_max+save_max)) + exit_margin, "
        "clamped to [min, max], from the timings in the newest complete checkpoint's "
        "preemptible_state.json; earlier SIGTERM-to-exit times are a lower bound.",
    )
    d = GracePolicy()
    p.add_argument("output_dir", help="output dir: a path or fsspec URL")
    p.add_argument(
        "--headroom", type=float, help=f"fraction added to step+save (default {d.headroom})"
    )
    p.add_argument(
        "--kill-wait", type=float, help=f"seconds before the save starts (default {d.kill_wait})"
    )
    p.add_argument(
        "--exit-margin",
        type=float,
        help=f"seconds to exit after the save (default {d.exit_margin})",
    )
    p.add_argument(
        "--stop-policy",
        choices=STOP_POLICIES,
        default="finish_step",
        help="the job's jit_stop_policy: micro_batch counts the longest micro-batch instead of "
        "the step (default finish_step)",
    )
    p.add_argument("--min", type=int, help=f"lower clamp in seconds (default {d.minimum})")
    p.add_argument("--max", type=int, help=f"upper clamp in seconds (default {d.maximum})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--storage-options", help="fsspec storage options as a JSON object")
    p.set_defaults(func=_cmd_grace)


# -- to-transformers --------------------------------------------------------------------------
def _cmd_to_transformers(args: argparse.Namespace) -> int:
    # torch only here: the other subcommands stay torch-free
    from trainer_runtime.checkpoint.hf_format import export_transformers_state

    written = export_transformers_state(args.checkpoint, _storage_options(args))
    if not written:
        raise CliError(f"{args.checkpoint} has no optimizer, scheduler or RNG state to export")
    print(f"wrote {', '.join(written)} into {args.checkpoint}")
    return 0


def _add_to_transformers(sub: Any) -> None:
    p = sub.add_parser(
        "to-transformers",
        help="add transformers.Trainer's optimizer.pt, scheduler.pt, rng_state*.pth to one",
        description="Convert CHECKPOINT's optimizer, scheduler and RNG state (complete checkpoint "
        "of this runtime) into the files transformers.Trainer reads on resume, written next to "
        "ours; the manifest is unchanged.",
    )
    p.add_argument("checkpoint", help="a checkpoint-<step> directory: a path or fsspec URL")
    p.add_argument("--storage-options", help="fsspec storage options as a JSON object")
    p.set_defaults(func=_cmd_to_transformers)


def _add_launch(sub: Any) -> None:
    from trainer_runtime.distributed.launch import add_launch_parser

    add_launch_parser(sub)


SUBCOMMANDS: dict[str, Callable[[Any], None]] = {
    "inspect": _add_inspect,
    "grace": _add_grace,
    "to-transformers": _add_to_transformers,
    "launch": _add_launch,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainer-runtime", description="Tools of the preemptible trainer runtime."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (CliError, TrainerRuntimeError) as exc:
        print(f"trainer-runtime {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
