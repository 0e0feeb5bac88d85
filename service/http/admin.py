"""`GET /v1/models` and `GET /v1/models/{id}`, the listing and the one model OpenAI-style clients, vLLM and
Infinity read (OpenAI's `models.list()` and `models.retrieve(id)`), and the admin route that
reloads a model: `POST /admin/models/{name}/reload`, optionally from a new path. The reload loads and
warms the new copy beside the old one and switches at once (service.runtime.models); a checkpoint that
fails leaves the old one serving and answers 422 reload_failed."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from service.errors import ErrorKind, ServiceError
from service.http.deps import EngineDep
from service.http.routes import ERRORS
from service.http.schemas import Absent

router = APIRouter(tags=["models"])  # protected by the API keys (app.PROTECTED_ROUTERS)
admin_router = APIRouter(tags=["admin"])  # protected by the admin keys (app.create_app)


class ModelCard(BaseModel):
    id: str = Field(description="the name requests give in `model`")
    object: str = "model"
    created: int = Field(description="when the serving copy was loaded (Unix seconds)")
    owned_by: str = "qtrel"
    path: str = Field(description="the checkpoint directory")
    levels: list[str]
    languages: list[str] | None = Field(None, description="the languages the model reads (its config's `languages`)")
    dtype: str
    device: str
    state: str = Field(description="loading, ready, reloading (a new copy loads), or the worker's state")
    generation: int = Field(description="load generation: 1 at start, one more per reload")
    default: bool = Field(description="answers requests that name no model")
    layout: dict = Field(description="its share of the cores: model processes x torch threads each")
    last_reload: dict = Field(description="the last reload's result, mode and seconds (empty before one)")
    job_processes: dict | None = Field(
        None,
        description="where score jobs' batches run (idle: processes of their own at idle priority); null: jobs off",
    )


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class ReloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"path": "/models/v3"}]})
    path: Annotated[StrictStr, Field(min_length=1, max_length=4096)] | Absent = Field(
        None, description="a checkpoint directory or builtin:NAME; absent: the model's own path, read again"
    )


@router.get("/v1/models", response_model=ModelList, responses={401: ERRORS[401]})
async def models(engine: EngineDep):
    """The served models, the default first."""
    return JSONResponse({"object": "list", "data": await engine.model_list()})


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={401: ERRORS[401], 404: ERRORS[404]})
async def model(model_id: str, engine: EngineDep):
    """One served model by its id (OpenAI's models.retrieve); 404 model_not_found for an id not served. Unlike
    the scoring routes, no other name stands in for the one model served: this route says what exists."""
    cards = await engine.model_list()
    for card in cards:
        if card["id"] == model_id:
            return JSONResponse(card)
    served = ", ".join(c["id"] for c in cards)
    raise ServiceError(ErrorKind.MODEL_NOT_FOUND, f"model {model_id!r} is not served; served: {served}")


@admin_router.post(
    "/admin/models/{name}/reload",
    response_model=ModelCard,
    responses={c: ERRORS.get(c, ERRORS[422]) for c in (401, 403, 404, 409, 422, 503)},
)
async def reload(name: str, engine: EngineDep, body: Annotated[ReloadRequest | None, Body()] = None):
    """Load the model again (or from `path`), beside the serving copy, and switch to it once warm: no
    request fails. 422 reload_failed (the old copy still serves) if it does not load or warm up, 409 while
    a reload of that model is under way, 404 for a name not served."""
    return JSONResponse(await engine.reload(name, body.path if body else None))
