"""Reading the runtime's /metrics (text parsing and a real HTTP scrape)."""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from preemptible_operator.scrape import parse_metrics, scrape
from trainer_runtime.protocol import METRIC_NAMES

TEXT = f"""# HELP {METRIC_NAMES["step"]} step
# TYPE {METRIC_NAMES["step"]} gauge
{METRIC_NAMES["step"]} 42.0
# TYPE {METRIC_NAMES["step_seconds_max"]} gauge
{METRIC_NAMES["step_seconds_max"]} 1.5
# TYPE {METRIC_NAMES["save_seconds_max"]} gauge
{METRIC_NAMES["save_seconds_max"]} NaN
# TYPE other_metric gauge
other_metric 7
"""


def test_parse_keeps_protocol_series_and_drops_nan() -> None:
    m = parse_metrics(TEXT)
    assert m.int("step") == 42
    assert m.get("step_seconds_max") == 1.5
    assert m.get("save_seconds_max") is None
    assert "other_metric" not in m.values


def test_scrape_a_live_endpoint_and_a_dead_one() -> None:
    registry = CollectorRegistry()
    Gauge(METRIC_NAMES["step"], "step", registry=registry).set(17)
    Gauge(METRIC_NAMES["last_complete_checkpoint_step"], "ckpt", registry=registry).set(15)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_port
        m = scrape("127.0.0.1", port)
        assert m is not None
        assert (m.int("step"), m.int("last_complete_checkpoint_step")) == (17, 15)
    finally:
        server.shutdown()
        thread.join(5)
    assert scrape("127.0.0.1", port, timeout=0.5) is None


def _serve(handler_body: bytes, trickle: float = 0.0) -> tuple[Any, int]:
    """A one-endpoint HTTP server that answers ``handler_body``, ``trickle`` s per 1 kB."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            for i in range(0, len(handler_body), 1024):
                try:
                    self.wfile.write(handler_body[i : i + 1024])
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(trickle)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def test_scrape_caps_the_body_size() -> None:
    """A pod that streams an endless body must not exhaust the operator's memory."""
    body = TEXT.encode() + b"# padding\n" * 200_000
    server, port = _serve(body)
    try:
        assert scrape("127.0.0.1", port, timeout=5, max_bytes=64 * 1024) is None
        assert scrape("127.0.0.1", port, timeout=5, max_bytes=len(body) + 1) is not None
    finally:
        server.shutdown()


def test_scrape_bounds_the_total_time() -> None:
    """A pod that trickles its answer (each read well within a per-read timeout) must not hold
    a worker longer than the scrape timeout in total."""
    server, port = _serve(TEXT.encode() * 40, trickle=0.3)
    try:
        t0 = time.monotonic()
        assert scrape("127.0.0.1", port, timeout=1.0) is None
        assert time.monotonic() - t0 < 2.0
    finally:
        server.shutdown()
