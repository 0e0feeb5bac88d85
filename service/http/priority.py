"""A scoring request's priority class: the body field `priority` where the body gives one, else the
`X-Priority` header (for a gateway or a client library that marks a whole caller's traffic without touching
its bodies), else high. Both take the same values: "high", "low", or an integer as vLLM's and Cohere's
priority (0 or less is high, above 0 is low). The body wins: it is the request's own word, the header a
default around it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from starlette.requests import Request

from service.errors import ErrorKind, ServiceError

HEADER = "X-Priority"
# The header in the OpenAPI schema of each scoring route (openapi_extra: a header parameter in the endpoint's
# signature would take the route out of the fast lane, service.http.fast).
OPENAPI: dict[str, Any] = {
    "parameters": [
        {
            "name": HEADER,
            "in": "header",
            "required": False,
            "description": "high, low or an integer (0 or less: high), as the body's priority; the body's wins",
            "schema": {"anyOf": [{"type": "string", "enum": ["high", "low"]}, {"type": "integer"}]},
        }
    ]
}


def priority_of(body: BaseModel, request: Request) -> str:
    """The request's class: "high" or "low"; a 422 for a header that says neither."""
    given: str = getattr(body, "priority", "high")
    if "priority" in body.model_fields_set:
        return given
    values = request.headers.getlist(HEADER)
    if not values:
        return given
    value = values[0].strip().lower()
    if len(values) == 1 and value in ("high", "low"):
        return value
    try:
        if len(values) == 1 and len(value) <= 12:
            return "high" if int(value) <= 0 else "low"
    except ValueError:
        pass
    raise ServiceError(ErrorKind.VALIDATION, f"{HEADER}: high, low or an integer, once; got {', '.join(values)!r}")
