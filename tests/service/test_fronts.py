"""How many front processes `auto` runs, the port they share, their settings pipe, and /metrics merged across
processes."""

from __future__ import annotations

import errno
import json
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import ValidationError

from service.fronts import listening_socket, settings_for_front
from service.metrics_merge import FrontSamples, merge, samples
from service.runtime import layout
from service.settings import Settings


def test_http_workers_is_auto_by_default_a_number_or_refused(monkeypatch):
    assert Settings().http_workers == "auto"
    monkeypatch.setenv("QTREL_HTTP_WORKERS", "3")
    assert Settings().http_workers == 3
    for bad in ("0", "many", "65"):
        with pytest.raises(ValidationError):
            Settings(http_workers=bad)


@pytest.mark.parametrize(
    ("device", "cores", "fronts"), [("cpu", 2, 1), ("cpu", 7, 1), ("cpu", 16, 2), ("cpu", 64, 4), ("cuda", 16, 8)]
)
def test_auto_follows_the_cores_and_the_device(monkeypatch, device, cores, fronts):
    monkeypatch.setattr(layout, "usable_cores", lambda: cores)
    monkeypatch.setattr(layout, "resolve_device_name", lambda d: device)
    assert layout.resolve_http_workers(Settings()) == (fronts, f"auto: {device}, {cores} cores")
    assert layout.resolve_http_workers(Settings(http_workers=3)) == (3, "set")


def test_a_port_another_server_s_fronts_listen_on_is_in_use_even_with_reuseport():
    other = socket.socket()  # as another qtrel's front: SO_REUSEPORT, listening (same user)
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    with pytest.raises(OSError) as e:
        listening_socket("127.0.0.1", port, reuseport=True)  # without the probe: bound, half the connections
    assert e.value.errno == errno.EADDRINUSE
    other.close()
    mine = listening_socket("127.0.0.1", port, reuseport=True)  # free again: a restart on the same port
    mine.close()


def test_a_front_gets_the_settings_with_their_secrets_and_the_chosen_port():
    s = Settings(api_keys="k1,k2", admin_keys="adm", port=0, max_wait_ms=5)
    sent = json.loads(settings_for_front(s, 18123))
    front = Settings(**sent)
    assert front.keys == ("k1", "k2") and front.admin_keyring.keys == ("adm",)
    assert front.port == 18123 and front.http_workers == 1 and front.max_wait_ms == 5


def _registry(requests: float, seconds: list[float], depth: float | None) -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("qtrel_requests", "HTTP requests", ["route"], registry=r).labels("/score").inc(requests)
    h = Histogram("qtrel_seconds", "Duration", buckets=(0.01, 0.1), registry=r)
    for s in seconds:
        h.observe(s)
    g = Gauge("qtrel_queue_depth", "Pairs waiting", registry=r)
    if depth is not None:
        g.set(depth)
    return r


def test_metrics_merge_sums_counters_and_histograms_and_keeps_the_one_gauge():
    text = merge([samples(_registry(2, [0.005], 7)), samples(_registry(3, [0.05, 0.5], None))]).decode()
    assert 'qtrel_requests_total{route="/score"} 5.0' in text
    assert 'qtrel_seconds_bucket{le="0.01"} 1.0' in text and 'qtrel_seconds_bucket{le="0.1"} 2.0' in text
    assert "qtrel_seconds_count 3.0" in text and 'qtrel_seconds_bucket{le="+Inf"} 3.0' in text
    assert "qtrel_queue_depth 7.0" in text
    assert text.count("# TYPE qtrel_requests_total counter") == 1


def test_a_gone_front_keeps_its_counters_and_histograms_but_not_its_gauges():
    kept = FrontSamples()
    old, other = samples(_registry(2, [0.005], 4)), samples(_registry(3, [0.05], None))
    kept.seen("old", old)
    kept.seen("other", other)
    kept.left("old")
    kept.seen("new", samples(_registry(1, [], None)))  # its replacement starts from zero
    text = merge(kept.parts()).decode()
    assert 'qtrel_requests_total{route="/score"} 6.0' in text and "qtrel_seconds_count 2.0" in text
    assert "qtrel_queue_depth 0.0" in text  # the live fronts' gauges only
    kept.left("old")  # twice: counted once
    assert 'qtrel_requests_total{route="/score"} 6.0' in merge(kept.parts()).decode()
