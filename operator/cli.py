"""``preemptible-operator``: run the operator (``run``) or generate the CRD (``crd``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any

__all__ = ["build_parser", "main"]

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                data[key] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preemptible-operator", description="Kubernetes operator for TrainingJobs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the operator (kopf)")
    scope = run.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; glob patterns allowed); default: all namespaces",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch cluster-wide")
    run.add_argument(
        "--kubeconfig", help="kubeconfig file (default: in-cluster config, else $KUBECONFIG)"
    )
    run.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering object name (needs the kopf.dev peering CRDs); default: standalone",
    )
    run.add_argument("--priority", type=int, default=0, help="kopf peering priority")
    run.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="kopf liveness endpoint (empty disables)",
    )
    run.add_argument(
        "--metrics-port", type=int, default=8000, help="operator /metrics port (0 disables)"
    )
    run.add_argument(
        "--checkpoint-path-map",
        action="append",
        default=[],
        metavar="POD_PREFIX=OPERATOR_PREFIX",
        help="read checkpoints whose URI starts with POD_PREFIX at OPERATOR_PREFIX "
        "(repeatable; e.g. /checkpoints=/mnt/checkpoints, or /data=/data for the same path)",
    )
    run.add_argument(
        "--checkpoint-storage-options",
        default="",
        metavar="JSON",
        help="fsspec storage options (JSON object) for reading mapped checkpoint URLs with the "
        "operator's own credentials; user Secrets are never read",
    )
    run.add_argument(
        "--poll-interval",
        type=float,
        default=5.0,
        help="seconds between passes while an attempt runs (metrics scraping)",
    )
    run.add_argument(
        "--status-progress-interval",
        type=float,
        default=15.0,
        metavar="S",
        help="write a running job's progress (step, timings) alone to its status at most every S "
        "seconds; other status changes are written at once",
    )
    run.add_argument(
        "--max-scrapes-per-second",
        type=float,
        default=20.0,
        metavar="N",
        help="budget of periodic passes (rank-0 scrapes), all running jobs together: above "
        "poll-interval x N running jobs each job is polled less often (0: no budget)",
    )
    run.add_argument(
        "--max-progress-writes-per-second",
        type=float,
        default=10.0,
        metavar="N",
        help="budget of progress-only status writes, all running jobs together: above "
        "status-progress-interval x N running jobs each job's progress is written less often "
        "(0: no budget)",
    )
    run.add_argument(
        "--workers", type=int, default=32, help="threads running reconcile passes (API-bound)"
    )
    run.add_argument(
        "--heap-trim-interval",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="give the operator's freed heap memory back to the OS every SECONDS (glibc "
        "malloc_trim; after a burst of new TrainingJobs RSS would stay at its peak); 0: off",
    )
    run.add_argument("--no-scrape", action="store_true", help="do not read the pods' /metrics")
    run.add_argument(
        "--max-grace-seconds",
        type=int,
        default=None,
        metavar="S",
        help="cap every TrainingJob's grace period (pinned or computed) at S seconds",
    )
    run.add_argument(
        "--no-kueue",
        action="store_true",
        help="do not watch Kueue Workloads (Kueue not installed, or no RBAC for it)",
    )
    run.add_argument(
        "--priority-boost",
        action="store_true",
        help="keep annotation kueue.x-k8s.io/priority-boost on each running attempt's Workload "
        "so that, within one priority class, Kueue preempts the job that loses least now "
        "(needs Kueue's PriorityBoost feature gate; docs/operator.md, Checkpoint-aware victims)",
    )
    run.add_argument(
        "--priority-boost-max",
        type=int,
        default=100,
        metavar="N",
        help="top of the boost band [0, N] (N: protected by spec.preemption.minRunSeconds); "
        "lowered per Workload to stay below the next higher priority class value",
    )
    run.add_argument("--log-format", choices=("json", "text"), default="json")
    run.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    sub.add_parser("rbac", help="print the ClusterRole with exactly the access the operator uses")
    crd = sub.add_parser("crd", help="print, write or check the generated CRD YAML")
    group = crd.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    return parser


def _setup_logging(fmt: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    # The kubernetes client logs every request at DEBUG; kopf is chatty at INFO.
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("kopf").setLevel(logging.INFO if verbose else logging.WARNING)


def _run(args: argparse.Namespace) -> int:
    import kopf

    from preemptible_operator import handlers
    from preemptible_operator.checkpoint_store import parse_path_map
    from preemptible_operator.metrics import start_metrics_server
    from preemptible_operator.reconcile import OperatorConfig

    _setup_logging(args.log_format, args.verbose)
    if args.kubeconfig and not os.path.exists(args.kubeconfig):
        print(f"--kubeconfig {args.kubeconfig}: no such file", file=sys.stderr)
        return 2
    try:
        path_map = parse_path_map(args.checkpoint_path_map)
        options = json.loads(args.checkpoint_storage_options or "{}")
        if not isinstance(options, dict):
            raise ValueError("--checkpoint-storage-options must be a JSON object")
        for flag in ("max_scrapes_per_second", "max_progress_writes_per_second"):
            if getattr(args, flag) < 0:
                raise ValueError(
                    f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0 (0: no budget)"
                )
        if args.priority_boost_max < 1:
            raise ValueError(f"--priority-boost-max {args.priority_boost_max}: must be >= 1")
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    path_map = dataclasses.replace(path_map, storage_options=options)
    handlers.configure(
        OperatorConfig(
            path_map=path_map,
            scrape_metrics=not args.no_scrape,
            poll_interval=args.poll_interval,
            max_grace_seconds=args.max_grace_seconds,
            status_progress_interval=args.status_progress_interval,
            max_scrapes_per_second=args.max_scrapes_per_second,
            max_progress_writes_per_second=args.max_progress_writes_per_second,
            workers=args.workers,
            heap_trim_interval=args.heap_trim_interval,
            kueue=not args.no_kueue,
            priority_boost=args.priority_boost,
            priority_boost_max=args.priority_boost_max,
        ),
        kubeconfig=os.path.abspath(args.kubeconfig) if args.kubeconfig else None,
    )
    registry = handlers.register()
    start_metrics_server(args.metrics_port)
    kopf.run(
        registry=registry,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=args.liveness or None,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "rbac":
        import yaml

        from preemptible_operator.rbac import cluster_role

        sys.stdout.write(yaml.safe_dump(cluster_role(), sort_keys=False))
        return 0
    if args.command == "crd":
        from preemptible_operator import crd

        return crd.main(["--write"] if args.write else ["--check"] if args.check else [])
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
