"""What HTTP handlers may use, as typed dependencies (the FastAPI template's `deps.py`): the engine, the
settings and the metrics of this app, all created by the lifespan. Routes use nothing else of the service."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from service.errors import ErrorKind, ServiceError
from service.metrics import Metrics
from service.runtime.engine import EngineAPI
from service.settings import Settings


# async: a sync dependency costs a thread hop per request
async def get_engine(request: Request) -> EngineAPI:
    return request.state.engine


async def get_settings(request: Request) -> Settings:
    return request.state.settings


async def get_metrics(request: Request) -> Metrics:
    return request.state.metrics


EngineDep = Annotated[EngineAPI, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
TIMEOUT_MAX_MS = 3_600_000  # an hour: the longest deadline a request may set
# Optional, and never "null" in the schema: a header has no null (a fuzzer would send the text "null").
TimeoutHeader = Annotated[
    Annotated[int, Field(gt=0, le=TIMEOUT_MAX_MS)] | SkipJsonSchema[None], Header(alias="X-Request-Timeout-Ms")
]

NO_CACHE = (
    "`no-cache` (among other directives, case-insensitive): score the pairs afresh, past the pair-score cache "
    "(the fresh scores are cached); anything else, or no header: answer from the cache where it holds a pair"
)


async def use_cache(
    cache_control: Annotated[str | SkipJsonSchema[None], Header(alias="Cache-Control", description=NO_CACHE)] = None,
) -> bool:
    """False when the request says `Cache-Control: no-cache`: its pairs are scored afresh (and cached)."""
    return cache_control is None or "no-cache" not in (d.strip().lower() for d in cache_control.split(","))


UseCacheDep = Annotated[bool, Depends(use_cache)]  # every scoring route takes it: the schema states the header


bearer = HTTPBearer(auto_error=False, description="an API key (settings api_keys, api_keys_file)")


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """`Authorization: Bearer <key>` with one of the keys in force (the settings' keyring, whose key file is
    re-read when it changes); 401 otherwise. No keys: open. Each accepted request is counted under its key's
    id, never the key. app.py applies it to every router in its protected group."""
    ring = request.state.settings.keyring
    key_id = _match(ring, credentials, "API key")
    if key_id is not None:
        request.state.metrics.key_used(key_id, ring)


async def require_admin_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> None:
    """The admin routes' key: one of the admin keys (settings admin_keys, admin_keys_file), or of the API
    keys when no admin key is set; 401 otherwise. With no key at all the routes take `admin_off`."""
    _match(request.state.settings.admin_keyring, credentials, "admin key")


async def admin_off() -> None:
    """The admin routes where no key is set: 403, off. A reload from any path by whoever reaches the port
    is not a default; SIGHUP needs no key."""
    raise ServiceError(
        ErrorKind.FORBIDDEN,
        "the admin routes are off: set QTREL_ADMIN_KEYS (or QTREL_API_KEYS) to use them; SIGHUP reloads without a key",
    )


def _match(ring, credentials: HTTPAuthorizationCredentials | None, what: str) -> str | None:
    """The id of the key presented, None when the ring holds no key; 401 for no key or a wrong one."""
    ring.refresh()
    if not ring.keys:
        return None
    if credentials is None:
        raise ServiceError(ErrorKind.UNAUTHORIZED, f"this route needs an {what}: Authorization: Bearer <key>")
    key_id = ring.match(credentials.credentials)
    if key_id is None:
        raise ServiceError(ErrorKind.UNAUTHORIZED, f"invalid {what}")
    return key_id
