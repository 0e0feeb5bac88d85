"""The edge: the pure-ASGI layer in front of FastAPI. Per request it sets the request id, refuses a body over
the limit and a scoring request the engine would refuse anyway, hands a scoring request whose body it has
read to the fast lane (service.http.fast), and writes one log line and the request metrics."""

from __future__ import annotations

import logging
import random
import time

from service.errors import ErrorKind
from service.http.errors import as_service_error, error_response, response_for
from service.http.fast import FastLane
from service.http.jobs import UPLOAD_ROUTE
from service.logs import request_id
from service.metrics import Metrics

log = logging.getLogger("qtrel.http")

# Route label values for metrics; anything else is "other", so label cardinality stays bounded.
KNOWN_ROUTES = {
    "/score",
    "/predict",
    "/rerank",
    "/explain",
    "/explain/view",
    "/health/live",
    "/health/ready",
    "/livez",
    "/readyz",
    "/metrics",
    "/info",
    "/docs",
    "/openapi.json",
    "/v1/rerank",
    "/v2/rerank",
    "/tokenize",
    "/v1/models",
    "/v1/jobs",
    "/v1/jobs/{id}",  # and the routes under it: their ids are not labels
}
SCORING_ROUTES = {"/score", "/predict", "/rerank", "/v1/rerank", "/v2/rerank"}  # refused early when full
QUIET_ROUTES = {"/health/live", "/health/ready", "/livez", "/readyz", "/metrics"}


class EdgeMiddleware:
    """Request id, body-size limit, one log line and the request metrics per request (pure ASGI)."""

    def __init__(
        self, app, metrics: Metrics, max_body_bytes: int, lane: FastLane | None = None, max_upload_bytes: int = 0
    ):
        self.app = app
        self.metrics = metrics
        self.max_body = max_body_bytes
        self.max_upload = max_upload_bytes  # a job's upload streams to disk, counted there (service.http.jobs)
        self.lane = lane  # the scoring routes' valid requests, past FastAPI (service.http.fast)
        # Request ids: 128 random bits, not uuid4 (a getrandom call each, ~3% of a one-pair request's CPU);
        # a generator of its own, seeded from the OS, so that nobody's random.seed() repeats them.
        self.ids = random.Random()
        self.counted: dict[tuple[str, int], tuple] = {}  # (route, status) -> its metric series

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:64] or f"{self.ids.getrandbits(128):032x}"
        token = request_id.set(rid)
        path = scope["path"]
        route = path if path in KNOWN_ROUTES else "/v1/jobs/{id}" if path.startswith("/v1/jobs/") else "other"
        t0 = time.perf_counter()
        status = 500

        async def send_wrapped(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        try:
            engine = scope.get("state", {}).get("engine")  # the lifespan's state, once started
            if route in SCORING_ROUTES and engine is not None and (refusal := engine.refuse_early()) is not None:
                mapped = as_service_error(refusal)
                assert mapped is not None
                await response_for(mapped)(scope, receive, send_wrapped)
                return
            replay = receive
            if path == UPLOAD_ROUTE and scope["method"] == "POST":
                if self._declared_too_big(headers, self.max_upload):
                    resp = error_response(ErrorKind.TOO_LARGE, f"body is over {self.max_upload} bytes")
                    await resp(scope, receive, send_wrapped)
                    return
            elif scope["method"] in ("POST", "PUT", "PATCH"):
                first = None if self._declared_too_big(headers) else await self._buffer_body(receive)
                if first is None:
                    resp = error_response(ErrorKind.TOO_LARGE, f"body is over {self.max_body} bytes")
                    await resp(scope, receive, send_wrapped)
                    return
                if (
                    first["type"] == "http.request"
                    and self.lane
                    and await self.lane.serve(scope, first, receive, send_wrapped)
                ):
                    return
                replay = replaying(first, receive)
            await self.app(scope, replay, send_wrapped)
        finally:
            dt = time.perf_counter() - t0
            count, seconds = self._series(route, status)
            count.inc()
            seconds.observe(dt)
            if route not in QUIET_ROUTES or status >= 400:
                log.info(
                    "%s %s %d",
                    scope["method"],
                    path,
                    status,
                    extra={"status": status, "ms": round(dt * 1000, 2), "route": route},
                )
            request_id.reset(token)

    def _series(self, route: str, status: int) -> tuple:
        """The request counter and latency histogram of (route, status), looked up once: a label lookup is a
        lock and a validation each time."""
        series = self.counted.get((route, status))
        if series is None:
            m = self.metrics
            series = self.counted[(route, status)] = (
                m.requests.labels(route, str(status)),
                m.request_seconds.labels(route),
            )
        return series

    def _declared_too_big(self, headers, limit: int | None = None) -> bool:
        try:
            return int(headers.get(b"content-length", b"0")) > (self.max_body if limit is None else limit)
        except ValueError:
            return False  # a malformed length is the HTTP server's concern

    async def _buffer_body(self, receive):
        """The body as one message, read up to the limit (None beyond it), or the disconnect that came
        before its end."""
        chunks, size = [], 0
        first = None
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnect: hand it on as the first message
                first = msg
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}


def replaying(first: dict, receive):
    """A receive that hands the app `first`, then what the client sends next."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay
