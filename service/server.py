"""The uvicorn server both layouts run: the one process (service.cli) and each front (service.front).
SIGTERM turns readiness off at once (the lifecycle's drain switch), then uvicorn stops accepting and
answers the requests it holds (the engine still takes them), up to drain_timeout_s."""

from __future__ import annotations

from typing import Any

import uvicorn

from service.app import Lifecycle
from service.coalesce import TurnHttpProtocol
from service.settings import Settings


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.lifecycle.begin_drain()
        super().handle_exit(sig, frame)


def http_server(app: Any, settings: Settings, lifecycle: Lifecycle, **bind: Any) -> DrainingServer:
    """The server for `app`; `bind`: host and port (the one process), or nothing (a front is handed its
    socket at `run`). A fatal start (a model that cannot be loaded) stops it at once: no work to drain."""
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
        access_log=False,
        http=TurnHttpProtocol,  # one socket write per response (service.coalesce)
        **bind,
    )
    server = DrainingServer(config, lifecycle)

    def fatal(why: str) -> None:
        server.should_exit = True

    lifecycle.on_fatal = fatal
    return server
