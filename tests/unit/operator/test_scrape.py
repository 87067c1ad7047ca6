"""Reading the runtime's /metrics (text parsing and a real HTTP scrape)."""

from __future__ import annotations

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
