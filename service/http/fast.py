"""The scoring routes' fast lane: a plainly valid request to a scoring route goes straight to the route's
own endpoint, without FastAPI's per-request machinery (its middleware, routing, dependency solving),
which cost ~0.18 of the HTTP process's ~0.47 ms of CPU per one-pair request (bench/code_ab.py, Zen 4).

Same endpoint, same body model, same error map. The lane takes only what it can hand over exactly as
FastAPI would: a JSON body that validates, headers it reads without doubt. Anything else (a body that does
not parse or validate, a repeated or odd header, a content type other than JSON) goes the whole FastAPI
way, so every refusal of a malformed request is FastAPI's own. A route is in the lane only when its
endpoint takes exactly the scoring routes' parameters and no dependency but the API key
(`routes_of`): a route given anything new drops out of the lane, not into a half-served state."""

from __future__ import annotations

import json
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import fastapi.routing
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from service.http import deps
from service.http.errors import response_to

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
class LaneRoute:
    body: type[BaseModel]
    endpoint: Endpoint
    keyed: bool  # the API key is required (the router's require_api_key)


def routes_of(app: FastAPI) -> dict[str, LaneRoute]:
    """The POST routes the lane can serve: path -> route."""
    out: dict[str, LaneRoute] = {}
    for r in _routes(app):
        if r.methods == {"POST"} and "{" not in r.path and (lane := _lane_route(r)) is not None:
            out[r.path] = lane
    return out


def _routes(app: FastAPI) -> list[Any]:
    """Every API route with the dependencies its routers add (newer FastAPI includes routers lazily, and lists
    their routes with `iter_route_contexts`; older keeps `APIRoute`s in `app.routes`)."""
    contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    found = list(contexts(app.routes)) if contexts is not None else app.routes
    return [r for r in found if isinstance(getattr(r, "original_route", r), APIRoute)]


def _lane_route(r: Any) -> LaneRoute | None:
    try:
        hints = typing.get_type_hints(r.endpoint, include_extras=True)
    except (NameError, TypeError):
        return None
    hints.pop("return", None)
    body = hints.pop("body", None)
    if hints != PARAMS or not (isinstance(body, type) and issubclass(body, BaseModel)):
        return None
    guards = {d.dependency for d in r.dependencies}
    if not guards <= {deps.require_api_key}:
        return None
    return LaneRoute(body, r.endpoint, deps.require_api_key in guards)


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
