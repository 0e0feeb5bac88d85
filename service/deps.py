"""What HTTP handlers may use, as typed dependencies (the FastAPI template's `deps.py`): the engine, the
settings and the metrics of this app, all created by the lifespan. Routes use nothing else of the service."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from service.engine import Engine
from service.metrics import Metrics
from service.settings import Settings


# async: a sync dependency costs a thread hop per request
async def get_engine(request: Request) -> Engine:
    return request.state.engine


async def get_settings(request: Request) -> Settings:
    return request.state.settings


async def get_metrics(request: Request) -> Metrics:
    return request.state.metrics


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
TimeoutHeader = Annotated[int | None, Header(alias="X-Request-Timeout-Ms", gt=0, le=3_600_000)]
