"""The scoring routes' fast lane: a plainly valid request to a scoring route goes straight to the route's
own endpoint, without FastAPI's per-request machinery (its middleware, routing, dependency solving),
which cost ~0.18 of the HTTP process's ~0.47 ms of CPU per one-pair request (bench/code_ab.py, Zen 4).

Same endpoint, same body model, same error map. The lane takes only what it can hand over exactly as
FastAPI would: a JSON body that validates, headers it reads without doubt. Anything else (a body that does
not parse or validate, a repeated or odd header, a content type other than JSON) goes the whole FastAPI
way, so every refusal of a malformed request is FastAPI's own. The lane's routes are declared (`LANE`: path,
body model, endpoint); building the app checks each against the route FastAPI serves there (the same
endpoint, taking exactly the lane's parameters, no dependency but the API key) and refuses to start on a
mismatch, so a route given anything new is never served half-resolved. It reads FastAPI's routes with
`fastapi.routing.iter_route_contexts` and leaves requests carrying FastAPI's own telemetry to FastAPI:
FastAPI internals, hence the pinned range in pyproject.toml."""

from __future__ import annotations

import json
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from service.http import cohere, deps, routes
from service.http.errors import response_to
from service.http.schemas import PredictRequest, RerankRequest, ScoreRequest

Endpoint = Callable[..., Awaitable[Response]]
# The scoring routes' parameters (service.http.routes.score and its peers), each with what the lane passes.
PARAMS = {
    "request": Request,
    "engine": deps.EngineDep,
    "settings": deps.SettingsDep,
    "metrics": deps.MetricsDep,
    "use_cache": deps.UseCacheDep,
    "timeout_ms": deps.TimeoutHeader,
}
# A body with more brackets than this may nest deeply enough that decoding it hits the recursion limit at a
# depth that differs between the lane's shallow stack and FastAPI's: such bodies go FastAPI's way. (A body of
# 900 pairs for /predict has ~900.)
MAX_BRACKETS = 900


@dataclass(frozen=True)
class Declared:
    """A route the lane serves: its POST path, its body model and its endpoint."""

    path: str
    body: type[BaseModel]
    endpoint: Endpoint


# The lane's routes. A scoring route joins by a line here, once its endpoint takes exactly PARAMS and `body`.
LANE = (
    Declared("/score", ScoreRequest, routes.score),
    Declared("/predict", PredictRequest, routes.predict),
    Declared("/rerank", RerankRequest, routes.rerank),
    Declared("/v1/rerank", cohere.CompatRerankRequest, cohere.rerank_v1),
    Declared("/v2/rerank", cohere.CompatRerankRequest, cohere.rerank_v2),
)


class LaneMismatch(ValueError):
    """A declared lane route that the app serves otherwise than the lane would (a bug: the app does not start)."""


@dataclass(frozen=True)
class LaneRoute:
    body: type[BaseModel]
    endpoint: Endpoint
    keyed: bool  # the API key is required (the router's require_api_key)


def routes_of(app: FastAPI, declared: Iterable[Declared] = LANE) -> dict[str, LaneRoute]:
    """The declared routes this app serves, checked against FastAPI's: path -> route. A declared path the app
    does not serve is left out; one it serves otherwise raises LaneMismatch."""
    served = {
        c.path: c
        for c in iter_route_contexts(app.routes)
        if isinstance(c.original_route, APIRoute) and c.methods == {"POST"}
    }
    out: dict[str, LaneRoute] = {}
    for d in declared:
        if (route := served.get(d.path)) is not None:
            out[d.path] = _checked(d, route)
    return out


def _checked(d: Declared, route: Any) -> LaneRoute:
    def mismatch(why: str) -> LaneMismatch:
        return LaneMismatch(f"fast lane route POST {d.path}: {why} (service.http.fast.LANE)")

    if route.endpoint is not d.endpoint:
        raise mismatch(f"FastAPI serves {route.endpoint.__qualname__} there, not {d.endpoint.__qualname__}")
    hints = typing.get_type_hints(d.endpoint, include_extras=True)
    hints.pop("return", None)
    if hints != {"body": d.body, **PARAMS}:
        raise mismatch(
            f"its endpoint takes {sorted(hints)}, the lane passes body ({d.body.__name__}) and {sorted(PARAMS)}"
        )
    guards = {dep.dependency for dep in route.dependencies}
    if not guards <= {deps.require_api_key}:
        raise mismatch(f"its route has dependencies the lane does not run: {guards - {deps.require_api_key}}")
    return LaneRoute(d.body, d.endpoint, deps.require_api_key in guards)


class FastLane:
    def __init__(self, routes: dict[str, LaneRoute], app: FastAPI | None = None):
        self.routes = routes
        self.app = app  # while its dependency_overrides hold anything, FastAPI serves every request
        self.served = 0

    async def serve(self, scope: dict, first: dict, receive: Callable, send: Callable) -> bool:
        """Serve the request (True), or leave it to FastAPI (False: nothing was sent). `first` is the body's
        one message, already read; `receive` what follows it (the client's disconnect)."""
        route = self.routes.get(scope["path"])
        state = scope.get("state", {})
        if (
            route is None
            or scope["method"] != "POST"
            or "engine" not in state
            or scope.get("root_path")  # FastAPI routes on the path without it
            or scope.get("fastapi.telemetry") is not None  # FastAPI's own OpenTelemetry: its spans name routes
            or (self.app is not None and self.app.dependency_overrides)
        ):
            return False
        request = Request(scope, receive)
        try:
            body, timeout_ms, cache_control = _read(route, request, first)
        except Exception:  # _Leave, or anything odd in the reading (nothing is sent yet): FastAPI's way
            return False
        try:
            if route.keyed:
                await deps.require_api_key(request, await deps.bearer(request))
            response = await route.endpoint(
                body=body,
                request=request,
                engine=state["engine"],
                settings=state["settings"],
                metrics=state["metrics"],
                use_cache=await deps.use_cache(cache_control),
                timeout_ms=timeout_ms,
            )
        except Exception as e:  # the one error map, as FastAPI's exception handlers apply it
            response = response_to(e)
        self.served += 1
        await response(scope, receive, send)
        return True


class _Leave(Exception):
    """The lane leaves the request to FastAPI."""


def _read(route: LaneRoute, request: Request, first: dict) -> tuple[BaseModel, int | None, str | None]:
    """The body, the timeout and the Cache-Control header, each as FastAPI would read it; _Leave when the
    lane cannot be sure of that."""
    h = request.headers
    ctype = _single(h, "content-type")  # FastAPI reads no body as JSON without it
    if ctype is None or ctype.split(";", 1)[0].strip().lower() != "application/json":
        raise _Leave
    timeout, cache_control = _single(h, "x-request-timeout-ms"), _single(h, "cache-control")
    timeout_ms = None
    if timeout is not None:
        if not (
            len(timeout) <= 7 and timeout.isascii() and timeout.isdigit() and 0 < int(timeout) <= deps.TIMEOUT_MAX_MS
        ):
            raise _Leave
        timeout_ms = int(timeout)
    raw = first["body"]
    if raw.count(b"[") + raw.count(b"{") > MAX_BRACKETS:  # nested near the recursion limit: FastAPI's stack decides
        raise _Leave
    try:
        body = route.body.model_validate(json.loads(raw))
    except (ValueError, ValidationError):  # not JSON, or not this body: FastAPI says why
        raise _Leave from None
    return body, timeout_ms, cache_control


def _single(headers: Any, name: str) -> str | None:
    """The header's one value, None when absent; a repeated header is left to FastAPI's reading of it."""
    values = headers.getlist(name)
    if len(values) > 1:
        raise _Leave
    return values[0] if values else None
