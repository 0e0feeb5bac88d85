"""The one map from errors to HTTP: each kind's status, the runtime's own errors to a kind, and the one
JSON shape `{"error": str, "error_type": str}` (text-embeddings-inference's, so its clients work)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import ErrorKind, ServiceError
from service.logs import redact_private_texts
from service.runtime.engine import (
    BackendError,
    Closed,
    DeadlineExceeded,
    InferenceFailed,
    InputTooLong,
    ModelNotFound,
    NotReady,
    Overloaded,
    ReloadBusy,
    ReloadFailed,
    TooManyWindows,
    Unreadable,
)

log = logging.getLogger("qtrel.errors")

STATUS = {
    ErrorKind.BAD_REQUEST: 400,
    ErrorKind.VALIDATION: 422,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.MODEL_NOT_FOUND: 404,
    ErrorKind.CONFLICT: 409,
    ErrorKind.RELOAD_FAILED: 422,
    ErrorKind.METHOD: 405,
    ErrorKind.TIMEOUT: 408,
    ErrorKind.CLIENT_CLOSED: 499,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.RATE_LIMITED: 429,
    ErrorKind.NOT_READY: 503,
    ErrorKind.BACKEND: 500,
    ErrorKind.NO_SPACE: 507,
}

# Headers that every response of a kind carries (RFC 9110: a 401 names its scheme).
HEADERS = {ErrorKind.UNAUTHORIZED: {"WWW-Authenticate": "Bearer"}}

# The runtime's errors (service.runtime.engine), each with its kind; the first match wins (subclasses first).
RUNTIME_ERRORS: tuple[tuple[type[Exception], ErrorKind], ...] = (
    (Overloaded, ErrorKind.OVERLOADED),
    (Closed, ErrorKind.NOT_READY),
    (NotReady, ErrorKind.NOT_READY),
    (DeadlineExceeded, ErrorKind.TIMEOUT),
    (InputTooLong, ErrorKind.TOO_LARGE),
    (TooManyWindows, ErrorKind.TOO_LARGE),
    (Unreadable, ErrorKind.VALIDATION),
    (ModelNotFound, ErrorKind.MODEL_NOT_FOUND),
    (ReloadBusy, ErrorKind.CONFLICT),
    (ReloadFailed, ErrorKind.RELOAD_FAILED),
    (InferenceFailed, ErrorKind.BACKEND),
    (BackendError, ErrorKind.BACKEND),
)
MESSAGES: dict[type[Exception], str] = {DeadlineExceeded: "the request's deadline passed before it was scored"}


def as_service_error(exc: Exception) -> ServiceError | None:
    """The ServiceError a runtime error stands for; None for anything else."""
    for cls, kind in RUNTIME_ERRORS:
        if isinstance(exc, cls):
            retry = exc.retry_after if isinstance(exc, Overloaded) else 1 if kind == ErrorKind.NOT_READY else None
            return ServiceError(kind, MESSAGES.get(cls, str(exc)), retry_after=retry)
    return None


def error_response(kind: ErrorKind, message: str, retry_after: float | None = None) -> JSONResponse:
    headers = dict(HEADERS.get(kind, {}))
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    return JSONResponse({"error": message, "error_type": kind.value}, status_code=STATUS[kind], headers=headers or None)


def response_for(exc: ServiceError) -> JSONResponse:
    return error_response(exc.kind, exc.message, exc.retry_after)


def response_to(exc: Exception) -> JSONResponse:
    """What a route's exception answers: a ServiceError its own, a runtime error its kind's, anything else
    a logged 500. The app's exception handlers and the scoring routes' fast lane (service.http.fast) use it."""
    if isinstance(exc, ServiceError):
        return response_for(exc)
    if (mapped := as_service_error(exc)) is not None:
        return response_for(mapped)
    log.error("unhandled error", exc_info=exc)
    return error_response(ErrorKind.BACKEND, f"internal error: {type(exc).__name__}")


def _validation_message(exc: RequestValidationError) -> tuple[ErrorKind, str]:
    parts = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":
            return ErrorKind.BAD_REQUEST, f"body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return ErrorKind.VALIDATION, "; ".join(parts[:10]) or "invalid request"


def _log_refused(request: Request, kind: ErrorKind, msg: str, exc: RequestValidationError) -> None:
    """One line on why a request was refused: where and which rule, never the refused values (they may be a
    query or a title) unless log_texts is on. The response to the client says more (service.logs)."""
    settings = getattr(request.state, "settings", None)
    if settings is not None and settings.log_texts:
        values = json.dumps([e.get("input") for e in exc.errors()[:10]], ensure_ascii=False, default=str)
        log.info("refused (%s): %s; values %s", kind.value, msg, values)
        return
    rules = "; ".join(f"{_loc(e)}: {e.get('type')}" for e in exc.errors()[:10])
    log.info("refused (%s): %s", kind.value, rules)


def _not_json(request: Request, exc: RequestValidationError) -> bool:
    """The body was not read as JSON for its content type (FastAPI's strict content type), so the whole body
    failed as "not an object"."""
    ctype = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    json_type = ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json"))
    whole = [e for e in exc.errors() if tuple(e.get("loc", ())) == ("body",)]
    return not json_type and any(e.get("type") in ("model_attributes_type", "dict_type") for e in whole)


def _loc(error: Any) -> str:
    return ".".join(str(x) for x in error.get("loc", ()) if x != "body") or "body"


def install(app: FastAPI) -> None:
    # The handlers below, and uvicorn's log of an unhandled error, log in the request's context: there the
    # request's texts are taken out of every record (service.logs; a no-op after the first app).
    redact_private_texts()

    async def _mapped(_: Request, exc: Exception):
        return response_to(exc)

    mapped: list[type[Exception]] = [ServiceError, *(cls for cls, _ in RUNTIME_ERRORS), Exception]
    for cls in mapped:
        app.add_exception_handler(cls, _mapped)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        kind, msg = _validation_message(exc)
        if _not_json(request, exc):  # e.g. `curl -d`, which sends a form's content type
            ctype = request.headers.get("content-type") or "none"
            msg = f"the body must be JSON, sent with Content-Type: application/json (this request's: {ctype})"
        _log_refused(request, kind, msg, exc)
        return error_response(kind, msg)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = {
            401: ErrorKind.UNAUTHORIZED,
            404: ErrorKind.NOT_FOUND,
            405: ErrorKind.METHOD,
            400: ErrorKind.BAD_REQUEST,
        }.get(exc.status_code, ErrorKind.BAD_REQUEST)
        return error_response(kind, str(exc.detail))
