"""A stand-in for the trainer runtime in operator benchmarks: no torch, a few MB.

It speaks the operator contract: serves the runtime's /metrics series (names from
$STUB_METRIC_NAMES, a JSON object key -> series name that benchmarks/operator_scale.py fills from
trainer_runtime.protocol.METRIC_NAMES) on $PREEMPTIBLE_METRICS_HOST:$PREEMPTIBLE_METRICS_PORT and
advances its step every $STUB_STEP_SECONDS. It stops like the runtime after a JIT checkpoint
(termination message, exit 75) on SIGTERM, or when the file $STUB_CONTROL_DIR/$HOSTNAME.exit
appears ($HOSTNAME: <job>-<index>); it then writes the wall time of its exit to
$STUB_CONTROL_DIR/$HOSTNAME.exited (the benchmark's requeue clock starts there).

``benchmarks/stub_runtime.c`` is the same stand-in in C (about 1 MB a process instead of about
15, for thousands of pods on one machine): both serve ``$STUB_METRICS_TEMPLATE``
(``metrics_template``, every ``{step}`` replaced by the step); ``build_c_stub`` compiles it.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

EXIT_PREEMPTED = 75
STEP = "{step}"


def metrics_template(names: Mapping[str, str], step_seconds: float = 1.0) -> str:
    """The /metrics body both stubs serve, ``{step}`` standing for the step: the runtime's
    series (``names``: key -> series name, trainer_runtime.protocol.METRIC_NAMES)."""
    values: dict[str, object] = {
        "step": STEP,
        "max_steps": 1_000_000.0,
        "epoch": 0.0,
        "step_seconds_last": step_seconds,
        "step_seconds_ema": step_seconds,
        "step_seconds_p99": step_seconds,
        "step_seconds_max": step_seconds,
        "save_seconds_last": 0.0,
        "save_seconds_max": 0.0,
        "last_complete_checkpoint_step": 0.0,
        "stop_requested": 0.0,
    }
    return "".join(
        f"# TYPE {names[k]} gauge\n{names[k]} {v if v == STEP else float(v)}\n"  # type: ignore[arg-type]
        for k, v in values.items()
        if k in names
    )


def build_c_stub(cache: Path) -> Path:
    """``stub_runtime.c`` compiled with the machine's C compiler into ``cache`` (once per
    version of the source)."""
    source = Path(__file__).with_name("stub_runtime.c")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:12]
    binary = cache / f"stub_runtime-{digest}"
    if not binary.exists():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            raise RuntimeError("no C compiler (cc or gcc) to build benchmarks/stub_runtime.c")
        cache.mkdir(parents=True, exist_ok=True)
        partial = binary.with_suffix(".partial")
        subprocess.run([cc, "-O2", "-o", str(partial), str(source)], check=True)
        partial.replace(binary)
    return binary


def main() -> int:
    step_seconds = float(os.environ.get("STUB_STEP_SECONDS", "1"))
    template = os.environ.get("STUB_METRICS_TEMPLATE") or metrics_template(
        json.loads(os.environ["STUB_METRIC_NAMES"]), step_seconds
    )
    control = os.environ.get("STUB_CONTROL_DIR", "")
    pod = os.environ.get("HOSTNAME") or socket.gethostname()
    state = {"step": 0}
    stop = threading.Event()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the operator's scrape
            body = template.replace(STEP, f"{float(state['step'])}").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    host = os.environ.get("PREEMPTIBLE_METRICS_HOST", "127.0.0.1")
    port = int(os.environ.get("PREEMPTIBLE_METRICS_PORT", "9090"))
    server = http.server.ThreadingHTTPServer((host, port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    trigger = os.path.join(control, f"{pod}.exit") if control else None
    while not stop.wait(step_seconds):
        state["step"] += 1
        if trigger and os.path.exists(trigger):
            break
    message = {"reason": "preempted", "step": state["step"], "complete": False}
    log = os.environ.get("PREEMPTIBLE_TERMINATION_LOG")
    if log:
        with open(log, "w", encoding="utf-8") as fh:
            json.dump(message, fh)
    if control:
        with open(os.path.join(control, f"{pod}.exited"), "w", encoding="utf-8") as fh:
            fh.write(repr(time.time()))
    return EXIT_PREEMPTED


if __name__ == "__main__":
    sys.exit(main())
