"""/explain: why one pair got its score, and /explain/view, a page that draws it.

An explanation is one plain-path forward plus one batch of occluded copies: heavier than scoring a
pair, so it runs on the worker between batches (never in the batcher's hot path), and each app
rate-limits it with its own token bucket.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Response
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from service.errors import ErrorKind, ServiceError
from service.http.deps import EngineDep, MetricsDep
from service.http.routes import ERRORS, check_limits
from service.http.schemas import MODEL_FIELD, Absent, ErrorBody, ModelName, Text, WholeInt
from service.settings import Settings

VIEW = Path(__file__).resolve().parent / "static" / "explain.html"


class ExplainRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"query": "cordless drill", "title": "DEWALT 20V MAX Cordless Drill"}]},
    )
    query: Text
    title: Text
    truncation: Literal["only_second", "longest_first"] = "only_second"
    attention: StrictBool = Field(False, description="also return every layer's and head's (T, T) attention")
    top_heads: WholeInt = Field(5, ge=0, le=64, description="how many term-matching heads to list")
    model: ModelName | Absent = Field(None, description=MODEL_FIELD)

    @model_validator(mode="after")
    def _not_blank(self) -> ExplainRequest:
        for what in ("query", "title"):
            if not getattr(self, what).strip():
                raise ValueError(f"{what} is empty or whitespace")
        return self


class ExplainToken(BaseModel):
    token: str
    segment: int = Field(description="0 query, 1 title")
    special: bool


class HeadSummary(BaseModel):
    head: int
    cls: list[float] = Field(description="attention from [CLS] to each token")
    query_to_title: float = Field(description="mean over query tokens of their attention to title tokens")
    title_to_query: float


class LayerSummary(BaseModel):
    layer: int
    heads: list[HeadSummary]


class MatchingHead(BaseModel):
    layer: int
    head: int
    score: float = Field(description="mean of the two directions below")
    query_to_title: float = Field(
        description="mean over query tokens found in the title of their attention to those identical title tokens"
    )
    title_to_query: float


class Occlusion(BaseModel):
    replacement: str
    attribution: list[float | None] = Field(
        description="score drop when the token alone is replaced; null for special tokens"
    )


class ExplainResponse(BaseModel):
    model: str
    labels: list[str]
    level: str
    score: float = Field(description="expected level")
    probs: dict[str, float]
    truncated: bool
    tokens: list[ExplainToken]
    layers: list[LayerSummary]
    term_matching_heads: list[MatchingHead]
    occlusion: Occlusion
    attention: list[list[list[list[float]] | None]] | None = Field(
        None, description="[layer][head][from][to], 4 decimals; null for a pruned head"
    )


class RateLimiter:
    """Token bucket: `per_minute` calls a minute on average, bursts of up to `per_minute`. Used from
    the event loop only, so it needs no lock."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # tokens per second
        self.clock = clock
        self.tokens = self.capacity
        self.stamp = clock()

    def take(self) -> float | None:
        """Spend one token; None when allowed, else the seconds until one is available."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return None
        return (1 - self.tokens) / self.rate


def explain_routers(settings: Settings) -> tuple[APIRouter, APIRouter]:
    """The /explain API, with its own rate limiter (one per app), and the /explain/view page. The API is
    protected by app.py like the scoring routes; the page is static HTML that sends the key its user types
    in with each of its /explain calls, so it stays open."""
    router = APIRouter(tags=["explanations"])
    page = APIRouter(tags=["explanations"])
    limiter = RateLimiter(settings.explain_per_minute) if settings.explain_per_minute > 0 else None
    view = VIEW.read_text(encoding="utf-8")

    def check_enabled() -> None:
        if limiter is None:
            raise ServiceError(ErrorKind.NOT_FOUND, "explanations are disabled on this server (explain_per_minute=0)")

    @router.post("/explain", response_model=ExplainResponse, responses={**ERRORS, 404: {"model": ErrorBody}})
    async def explain(body: ExplainRequest, engine: EngineDep, metrics: MetricsDep):
        """Attention per layer and head, the heads that match identical query and title tokens, and
        each token's share of the score by occlusion. Rate-limited (explain_per_minute)."""
        check_enabled()
        assert limiter is not None
        check_limits(settings, [body.query], [body.title])
        engine.require_ready(body.model)
        wait = limiter.take()
        if wait is not None:
            metrics.rejected.labels("rate_limited").inc()
            raise ServiceError(
                ErrorKind.RATE_LIMITED, f"at most {settings.explain_per_minute} explanations a minute", retry_after=wait
            )
        out = await engine.explain(
            body.query,
            body.title,
            model=body.model,
            truncation=body.truncation,
            top_heads=body.top_heads,
            attention=body.attention,
        )
        # Full attention matrices make large bodies: serialise off the event loop.
        content = await asyncio.to_thread(json.dumps, out, separators=(",", ":"))
        return Response(content, media_type="application/json")

    @page.get("/explain/view", response_class=HTMLResponse, responses={404: {"model": ErrorBody}})
    async def explain_view():
        """A page with a form that draws an explanation: attention between query and title tokens for
        one layer and head, [CLS] attention, occlusion attribution, the level's probabilities."""
        check_enabled()
        return HTMLResponse(view)

    return router, page
