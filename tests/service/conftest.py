"""A real uvicorn server, in a thread, running the real app on the tiny checkpoint."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from service.app import Lifecycle, create_app
from service.coalesce import TurnHttpProtocol
from service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, settings: Settings, **app_options):
        self.settings = settings
        self.lifecycle = Lifecycle()
        self.app = create_app(settings, self.lifecycle, **app_options)  # app_options: create_app's, e.g. tracing
        self.url = f"http://127.0.0.1:{settings.port}"
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=settings.port,
            log_config=None,
            access_log=False,
            lifespan="on",
            http=TurnHttpProtocol,  # as service.server runs it
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def engine(self):
        return self.lifecycle.engine

    def start(self, wait_ready: bool = True) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/health/ready", timeout=2)
                if r.status_code == 200 or not wait_ready:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def metric(self, name: str, **labels) -> float:
        """Sum of a metric's samples (matching labels) from the live /metrics."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            series, value = line.rsplit(" ", 1)
            base, _, lab = series.partition("{")
            if base != name:
                continue
            if all(f'{k}="{v}"' in lab for k, v in labels.items()):
                total += float(value)
        return total


@contextmanager
def live_server(model_dir, wait_ready: bool = True, app_options: dict | None = None, **overrides):
    # float32 unless a test asks otherwise: the batch-invariance checks compare to a float32 reference
    overrides.setdefault("dtype", "float32")
    overrides.setdefault("inference", "torch")  # and the torch forward they compare with (auto may pick OpenVINO)
    overrides.setdefault("warmup", False)  # a model the fork server's template is not warms its whole ladder: ~15 s
    one = {} if overrides.get("models") else {"model": str(model_dir)}  # several models replace the one
    s = Settings(**one, port=free_port(), host="127.0.0.1", log_json=False, **overrides)
    srv = LiveServer(s, **(app_options or {})).start(wait_ready=wait_ready)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=5) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)
