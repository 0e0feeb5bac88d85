"""The composition root: create_app's lifespan resolves the runtime once and wires worker, batcher and
engine; the lifecycle hook drains through the engine; the edge middleware labels and tags requests.
Through the real app and lifespan on the tiny checkpoint (model on a thread, so no process start)."""

from __future__ import annotations

import re
import time

import pytest
from fastapi.testclient import TestClient

from service.app import Lifecycle, build_engine, create_app
from service.metrics import Metrics
from service.runtime.layout import package_version, resolve_runtime
from service.settings import Settings


def settings_for(model_dir, **overrides) -> Settings:
    fields = dict(model=str(model_dir), device="cpu", dtype="float32", worker="thread", warmup=False, log_json=False)
    return Settings(**(fields | overrides))


@pytest.fixture(scope="module")
def app_client(tiny_checkpoint):
    lifecycle = Lifecycle()
    settings = settings_for(tiny_checkpoint)
    with TestClient(create_app(settings, lifecycle)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health/ready").status_code != 200:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.02)
        yield client, lifecycle, settings


def test_the_lifespan_wires_the_parts_from_one_resolved_runtime(app_client):
    client, lifecycle, settings = app_client
    engine = lifecycle.engine
    assert engine is not None and engine.settings is settings
    assert engine.runtime == resolve_runtime(settings)
    assert engine.worker.spec == engine.runtime.load_spec(settings)
    assert engine.batcher.concurrency == engine.worker.size == engine.runtime.replicas == 1
    info = client.get("/info").json()
    assert info["version"] == package_version() == client.app.version
    assert info["model_path"] == str(engine.runtime.model_dir) and info["worker"]["mode"] == "thread"


def test_build_engine_hands_the_process_worker_its_layout_and_watchdog(tmp_path):
    s = Settings(model=str(tmp_path), device="cpu", dtype="float32", replicas=3, threads=1, batch_timeout_s=5)
    engine = build_engine(s, Metrics())  # nothing starts until engine.start()
    assert engine.worker.mode == "process" and engine.worker.size == engine.batcher.concurrency == 3
    assert engine.worker.batch_timeout_s == 5 and engine.worker.spec.threads == 1
    assert engine.worker.pids == [] and engine.readiness() == (False, "loading")


def test_the_edge_tags_requests_and_bounds_route_labels(app_client):
    client, _, _ = app_client
    r = client.post("/score", json={"query": "q", "titles": ["t"]})
    assert r.status_code == 200 and re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert client.get("/score", headers={"X-Request-Id": "given"}).headers["x-request-id"] == "given"
    assert client.get("/no/such/route").status_code == 404
    metrics = client.get("/metrics").text
    assert 'qtrel_requests_total{route="other",status="404"} 1.0' in metrics
    assert 'qtrel_requests_total{route="/score",status="200"} 1.0' in metrics


def test_lifecycle_drains_through_the_engine(tiny_checkpoint):
    Lifecycle().begin_drain()  # before the lifespan ran: nothing to drain, no error
    lifecycle = Lifecycle()
    with TestClient(create_app(settings_for(tiny_checkpoint), lifecycle)) as client:
        while client.get("/health/ready").status_code != 200:
            time.sleep(0.02)
        lifecycle.begin_drain()
        r = client.get("/health/ready")
        assert r.status_code == 503 and r.json() == {"error": "not ready: draining", "error_type": "not_ready"}
        assert client.get("/health/live").status_code == 200  # draining is not dead
        # a request the HTTP server still holds is answered, as a front answers it: it was sent before the signal
        assert client.post("/score", json={"query": "q", "titles": ["t"]}).status_code == 200
        assert "qtrel_ready 0.0" in client.get("/metrics").text


def test_fastapis_own_telemetry_is_off_unless_qtrel_traces(tiny_checkpoint):
    # FastAPI looks up OpenTelemetry's global providers on every request unless told not to; qtrel's tracing is its
    # own, so without it the lookups are switched off (FastAPI 0.165's `telemetry` argument; pinned in pyproject)
    from service.tracing import Tracing

    class On(Tracing):
        enabled = True

        def instrument(self, app) -> None:  # the contrib instrumentation needs the otel extra: not under test here
            pass

    off = create_app(settings_for(tiny_checkpoint), Lifecycle())
    assert not off._native_telemetry.enabled() and not off._telemetry["tracing"]
    on = create_app(settings_for(tiny_checkpoint), Lifecycle(), tracing=On())
    assert on._telemetry["tracing"] and on._telemetry["metrics"]
