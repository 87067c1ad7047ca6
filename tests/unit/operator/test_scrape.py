"""Reading the runtime's /metrics (text parsing and a real HTTP scrape)."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from typing import Any

import kubernetes
import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from preemptible_operator.reconcile import OperatorConfig, Reconciler
from preemptible_operator.scrape import parse_metrics, scrape
from tests.unit.operator.builders import make_pod, make_spec
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


@pytest.mark.parametrize(
    ("value", "kept"),
    [
        ("+Inf", None),
        ("-Inf", None),
        ("Inf", None),
        ("NaN", None),
        ("1e400", None),  # overflows to inf when parsed
        ("17", 17),
        ("17.0", 17),
        ("-0", 0),
    ],
)
def test_a_non_finite_step_gauge_is_no_measurement(value: str, kept: int | None) -> None:
    """int() of an infinite gauge raised in every periodic pass of the job (issue 39)."""
    m = parse_metrics(f"# TYPE {METRIC_NAMES['step']} gauge\n{METRIC_NAMES['step']} {value}\n")
    assert m.int("step") == kept


def test_scrape_a_live_endpoint_and_a_dead_one() -> None:
    registry = CollectorRegistry()
    Gauge(METRIC_NAMES["step"], "step", registry=registry).set(17)
    Gauge(METRIC_NAMES["last_complete_checkpoint_step"], "ckpt", registry=registry).set(15)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_port
        before = time.time()
        m = scrape("127.0.0.1", port)
        assert m is not None
        assert (m.int("step"), m.int("last_complete_checkpoint_step")) == (17, 15)
        # The step's time: what the lost-steps estimate extrapolates from.
        assert m.scraped_at is not None and before <= m.scraped_at <= time.time()
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


def _trickle_server(head: bytes, trickled: bytes, every: float, stop: threading.Event) -> int:
    """A raw TCP server: to each request it sends ``head`` at once, then ``trickled`` one byte
    per ``every`` seconds (each read well within any per-read timeout), until ``stop``."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)

    def serve() -> None:
        with listener:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.recv(4096)  # the request
                    try:
                        conn.sendall(head)
                        for i in range(len(trickled)):
                            if stop.wait(every):
                                break
                            conn.sendall(trickled[i : i + 1])
                    except OSError:
                        pass  # the client gave up

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


@pytest.mark.parametrize(
    ("head", "trickled"),
    [
        # the status line itself, one byte at a time
        (b"", b"HTTP/1.1 200 OK\r\n" + b"X" * 40),
        # a header line that never ends
        (b"HTTP/1.1 200 OK\r\n", b"X-Slow: " + b"y" * 50),
        # header after header, each complete
        (b"HTTP/1.1 200 OK\r\n", b"".join(b"X-%d: v\r\n" % i for i in range(8))),
    ],
)
def test_scrape_bounds_the_status_line_and_headers(head: bytes, trickled: bytes) -> None:
    """One deadline for the whole request (issue 30): a pod that trickles its status line or
    headers (a byte every 0.2 s) must not hold a pass past the scrape timeout. A correctness
    bound with a margin for a loaded machine, not a speed target."""
    stop = threading.Event()
    port = _trickle_server(head, trickled, 0.2, stop)
    try:
        t0 = time.monotonic()
        assert scrape("127.0.0.1", port, timeout=1.0) is None
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
    assert elapsed < 1.0 + 0.5, elapsed


def test_rank0_that_stops_answering_is_an_unanswered_scrape() -> None:
    """The pass tells a rank 0 that runs but no longer answers (a lost node: the upper bound
    of its training, attempts[].unreachableSince) from one with nothing to scrape (issue 39)."""
    registry = CollectorRegistry()
    Gauge(METRIC_NAMES["step"], "step", registry=registry).set(17)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_port
    reconciler = Reconciler(kubernetes.client.ApiClient(), OperatorConfig(scrape_timeout=0.5))
    spec = make_spec(metricsPort=port)
    rank0 = make_pod(index=0)
    rank0["status"]["podIP"] = "127.0.0.1"
    other = make_pod("tj-a1-1-x", index=1)
    other["status"]["podIP"] = "127.0.0.2"
    try:
        m = reconciler._scrape_rank0([other, rank0], spec)
        assert m is not None and m.answered and m.int("step") == 17
    finally:
        server.shutdown()
        thread.join(5)
    before = time.time()
    m = reconciler._scrape_rank0([other, rank0], spec)
    assert m is not None and not m.answered and m.values == {}
    assert m.scraped_at is not None and before <= m.scraped_at <= time.time()
    # no running rank 0 with an address: nothing was asked
    assert reconciler._scrape_rank0([other], spec) is None
    pending = make_pod(index=0, phase="Pending")
    pending["status"]["podIP"] = "127.0.0.1"
    assert reconciler._scrape_rank0([pending], spec) is None
