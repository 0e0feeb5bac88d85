"""Tracing: off by default, on with the OTEL_* environment; on the live server a request with a W3C
traceparent yields its request span and the tokenize, queue-wait and forward spans in that trace."""

from __future__ import annotations

import asyncio
import sys
import time

import httpx
import pytest

from service import tracing
from service.runtime.batcher import Batcher
from tests.service.conftest import live_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.mark.parametrize(
    "env, on",
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp,console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_TRACES_EXPORTER": "console"}, False),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "console"}, True),
    ],
)
def test_the_standard_environment_switches_it(env, on):
    assert tracing.wanted(env) is on


def test_off_is_a_no_op_that_needs_no_opentelemetry():
    t = tracing.from_env({})
    assert type(t) is tracing.Tracing and not t.enabled and t.batch_tracer is None and t.context() is None
    with t.span("x", pairs=1) as s:
        s.set_attribute("k", 1)
    t.instrument(object())
    t.shutdown()


def test_without_the_packages_the_service_runs_untraced(monkeypatch, caplog):
    for name in [m for m in sys.modules if m.startswith("opentelemetry.sdk")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)  # import fails as if not installed
    with caplog.at_level("WARNING", logger="qtrel.tracing"):
        t = tracing.from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert not t.enabled and "qtrel[otel]" in caplog.text


def test_the_environment_builds_a_provider_with_its_exporters():
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    t = tracing.from_env({"OTEL_TRACES_EXPORTER": "console"})
    try:
        assert t.enabled and t.provider.resource.attributes["service.name"] == "qtrel"
    finally:
        t.shutdown()


def test_the_batcher_reports_timings_to_its_tracer_without_knowing_otel():
    calls = []

    class Recorder:
        def batch(self, traces, enqueued, started, ended, lengths, error):
            calls.append((list(traces), list(enqueued), started, ended, list(lengths), error))

    async def run(payloads):
        await asyncio.sleep(0.01)
        return payloads

    async def main():
        b = Batcher(
            run,
            max_batch_tokens=1000,
            max_batch_size=8,
            max_wait_s=0.01,
            max_queue_items=100,
            max_queue_tokens=10_000,
            tracer=Recorder(),
        )
        b.start()
        try:
            await asyncio.gather(*b.submit([(3, "a"), (5, "b")], trace="ctx-1"), *b.submit([(4, "c")]))
        finally:
            await b.stop()

    asyncio.run(main())
    ((traces, enqueued, started, ended, lengths, error),) = calls
    assert sorted(map(str, traces)) == ["None", "ctx-1", "ctx-1"]  # one batch; the untraced item says None
    assert sorted(lengths) == [3, 4, 5] and error is None
    assert all(t <= started for t in enqueued) and ended - started >= 0.01


# --- on the live server, with the SDK's in-memory exporter ------------------------------------------------
@pytest.fixture(scope="module")
def traced(tiny_checkpoint):
    pytest.importorskip("opentelemetry.instrumentation.fastapi", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with live_server(tiny_checkpoint, max_wait_ms=5, app_options={"tracing": tracing.OtelTracing(provider)}) as srv:
        yield srv, exporter


def spans_of(exporter, trace_id: int, names: set[str], timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def test_a_request_with_a_traceparent_joins_that_trace(traced):
    srv, exporter = traced
    titles = ["DEWALT 20V MAX Cordless Drill", "Garden hose 50 ft", "Drill bits"]
    r = httpx.post(
        srv.url + "/v1/rerank",
        json={"query": "cordless drill", "documents": titles},
        headers={"traceparent": TRACEPARENT},
    )
    assert r.status_code == 200, r.text
    want = {"qtrel.tokenize", "qtrel.queue_wait", "qtrel.forward"}
    spans = spans_of(exporter, int(TRACE_ID, 16), want | {"POST /v1/rerank"})
    by_name = {s.name: s for s in spans}
    assert want <= set(by_name), sorted(by_name)
    server = by_name["POST /v1/rerank"]
    assert server.parent is not None and server.parent.span_id == int(PARENT_ID, 16)  # the caller's span
    for name in want:
        assert by_name[name].parent.span_id == server.context.span_id
    assert by_name["qtrel.tokenize"].attributes["qtrel.pairs"] == 3
    assert by_name["qtrel.tokenize"].attributes["qtrel.tokens"] > 3 * 3
    fwd = by_name["qtrel.forward"]
    assert fwd.attributes["qtrel.batch.size"] >= 3 and fwd.attributes["qtrel.pairs"] == 3
    assert fwd.attributes["qtrel.batch.tokens"] <= fwd.attributes["qtrel.batch.padded_tokens"]
    wait = by_name["qtrel.queue_wait"]
    assert wait.start_time <= wait.end_time <= fwd.start_time + 1_000_000 and fwd.start_time <= fwd.end_time
    assert server.start_time <= by_name["qtrel.tokenize"].start_time and fwd.end_time <= server.end_time


def test_without_a_traceparent_a_new_trace_and_probes_are_not_traced(traced):
    srv, exporter = traced
    exporter.clear()
    assert httpx.get(srv.url + "/health/ready").status_code == 200
    r = httpx.post(srv.url + "/score", json={"query": "drill", "titles": ["cordless drill"]})
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while not any(s.name == "POST /score" for s in exporter.get_finished_spans()) and time.monotonic() < deadline:
        time.sleep(0.02)
    spans = exporter.get_finished_spans()
    server = next(s for s in spans if s.name == "POST /score")
    assert server.parent is None and server.context.trace_id != int(TRACE_ID, 16)
    assert not any("health" in s.name for s in spans)


def test_the_otlp_environment_exports_the_spans_over_http(tiny_checkpoint, monkeypatch):
    """From the environment alone: OTEL_EXPORTER_OTLP_ENDPOINT -> OTLP/HTTP protobuf posts to /v1/traces."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra is not installed")
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[tuple[str, str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, self.headers["Content-Type"], body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    collector = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{collector.server_port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "qtrel-under-test")
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    try:
        with live_server(tiny_checkpoint, max_wait_ms=5, replicas=1) as srv:
            r = httpx.post(
                srv.url + "/score",
                json={"query": "drill", "titles": ["cordless drill"]},
                headers={"traceparent": TRACEPARENT},
            )
            assert r.status_code == 200
        # the lifespan's end shut the provider down, which flushed the batch processor
    finally:
        collector.shutdown()
    assert received and all(p == "/v1/traces" and t == "application/x-protobuf" for p, t, _ in received)
    names, services = set(), set()
    for _, _, body in received:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            services |= {a.value.string_value for a in rs.resource.attributes if a.key == "service.name"}
            for ss in rs.scope_spans:
                names |= {s.name for s in ss.spans if s.trace_id.hex() == TRACE_ID}
    assert services == {"qtrel-under-test"}
    assert {"POST /score", "qtrel.tokenize", "qtrel.queue_wait", "qtrel.forward"} <= names
