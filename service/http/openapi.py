"""The OpenAPI schema the app serves states the limits the server enforces, with the effective settings'
values, so that generated clients and fuzzers see them.

The request models (service/schemas.py) mark each limit that is a setting with the Settings field that holds
it (`"x-qtrel-limits": {"maxLength": "max_text_chars"}`); here each mark becomes that field's value
(`"maxLength": 2000`). routes.check_limits enforces the same fields, with the 413 the error table of docs/api.md
gives: one source for each limit, one check. The body size (`max_body_bytes`) has no JSON Schema keyword: the
413 responses say it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from service.http.schemas import LIMITS
from service.settings import Settings


def install(app: FastAPI, settings: Settings) -> None:
    """Serve the app's schema with its limits stated from `settings` (create_app calls it)."""
    generate = app.openapi
    done = False

    def openapi() -> dict[str, Any]:
        nonlocal done
        schema = generate()  # FastAPI builds it once and caches it
        if not done:
            state_limits(schema, settings)
            done = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema


def state_limits(schema: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Replace, in place, every limit mark with the settings' value, and say on each 413 what it is for."""
    _resolve(schema, settings)
    too_large = (
        f"payload_too_large: a body over {settings.max_body_bytes} bytes, more than "
        f"{settings.max_pairs_per_request} pairs, a text over {settings.max_text_chars} characters, or (on "
        "/predict and /rerank with truncate false) a pair over the model's max_length tokens"
    )
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if "413" in operation.get("responses", {}):
                operation["responses"]["413"]["description"] = too_large
    return schema


def _resolve(node: Any, settings: Settings) -> None:
    if isinstance(node, dict):
        for keyword, field in node.pop(LIMITS, {}).items():
            node[keyword] = getattr(settings, field)
        for value in node.values():
            _resolve(value, settings)
    elif isinstance(node, list):
        for value in node:
            _resolve(value, settings)
