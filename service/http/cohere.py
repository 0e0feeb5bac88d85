"""The rerank shape the rest of the field speaks: Cohere's `/v1/rerank` and `/v2/rerank`, which Jina,
vLLM, Infinity and LangChain's or LlamaIndex's Cohere rerankers send too.

A 5-level model has no single relevance logit, so `relevance_score` is the expected level mapped onto
0..1: (E - lo) / (hi - lo) for the model's lowest and highest level values, (E - 1) / (k - 1) for levels
1..k. It ranks exactly as `/score`'s `score` does.

And TEI's `/tokenize`, for pairs: the tokens the model sees and what truncation cut, without a forward pass.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from model.levels import unit_score
from service.http.deps import EngineDep, MetricsDep, SettingsDep, TimeoutHeader, UseCacheDep
from service.http.routes import ERRORS, score_watched, window_of
from service.http.schemas import (
    MAX_CHUNKS,
    OVERLAP,
    PAIRS,
    PRIORITY,
    AtLeastOne,
    Overlap,
    Priority,
    Text,
    WindowResult,
    check_windows,
    limited,
)
from service.runtime.engine import Windowed

router = APIRouter(tags=["rerank (Cohere, Jina)"])

RELEVANCE = (
    "the expected level mapped onto 0..1: (E - lo) / (hi - lo) for the model's lowest and highest level values, "
    "(E - 1) / (k - 1) for levels 1..k; ranks as /score's `score`"
)
MODEL_NOTE = (
    "the served model to answer (GET /v1/models lists them). With one model served any name is accepted "
    "(Cohere's clients always send one); with several, a name not served gets 404 model_not_found. The "
    "response's `model` says which answered"
)


class Document(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere v1 lets a document carry other fields; only `text` is read
    text: Text


class CompatRerankRequest(BaseModel):
    """Cohere's rerank request. Other fields Cohere's SDK sends (rank_fields, relevant_spans, ...) are accepted
    and ignored."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [
                {
                    "model": "qtrel",
                    "query": "cordless drill",
                    "documents": ["DEWALT 20V MAX Cordless Drill", "Garden hose 50 ft"],
                    "top_n": 1,
                    "return_documents": True,
                }
            ],
            "dependentRequired": {"chunk_overlap": ["max_chunks_per_doc"]},
        },
    )
    model: str | None = Field(None, description=MODEL_NOTE)
    priority: Priority = Field("high", description=PRIORITY)
    query: Text
    documents: list[Text | Document] = Field(
        min_length=1, description="strings or objects with a `text` field", json_schema_extra=limited(maxItems=PAIRS)
    )
    top_n: AtLeastOne | None = Field(None, description="return only the best n (all when absent)")
    return_documents: StrictBool = Field(False, description="add each result's `document: {text}`")
    max_tokens_per_doc: AtLeastOne | None = Field(
        None,
        description="accepted; not applied: a pair is cut to the model's max_length tokens (only the "
        "title is cut, see /tokenize)",
    )
    max_chunks_per_doc: AtLeastOne | None = Field(None, description=MAX_CHUNKS.replace("title", "document"))
    chunk_overlap: Overlap | None = Field(None, description=OVERLAP + " (qtrel's, not Cohere's)")

    @model_validator(mode="after")
    def _not_blank(self) -> CompatRerankRequest:
        check_windows(self.max_chunks_per_doc, self.chunk_overlap, "max_chunks_per_doc")
        if not self.query.strip():
            raise ValueError("query is empty or whitespace")
        for i, t in enumerate(self.texts()):
            if not t.strip():
                raise ValueError(f"document {i} is empty or whitespace")
        return self

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankDocument(BaseModel):
    text: str


class CompatRerankResult(BaseModel):
    index: int = Field(description="position of the document in the request")
    relevance_score: float = Field(description=RELEVANCE)
    document: RerankDocument | None = Field(None, description="only with return_documents")
    window: WindowResult | None = Field(
        None, description="with max_chunks_per_doc: the window whose score this is (qtrel's, not Cohere's)"
    )


class CompatRerankResponse(BaseModel):
    id: str
    model: str = Field(description="the served model that scored")
    results: list[CompatRerankResult] = Field(description="best first")
    meta: dict[str, Any] = Field(
        description="Cohere's api_version, billed_units (search_units: one per 100 documents, input_tokens) and tokens"
    )
    usage: dict[str, int] = Field(description="Jina's and vLLM's: total_tokens")


async def rerank(
    version: str,
    body: CompatRerankRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    timeout_ms: int | None,
    use_cache: bool,
) -> JSONResponse:
    texts = body.texts()
    scored = await score_watched(
        request,
        engine,
        settings,
        metrics,
        [body.query] * len(texts),
        texts,
        timeout_ms,
        body.max_chunks_per_doc,
        body.chunk_overlap,
        use_cache=use_cache,
        model=body.model,
        priority=body.priority,
    )
    results: list[dict[str, Any]] = []
    for i, out in enumerate(scored.outputs):
        r: dict[str, Any] = {"index": i, "relevance_score": unit_score(out.expected, scored.labels)}
        if body.return_documents:
            r["document"] = {"text": texts[i]}
        if (w := window_of(scored, i)) is not None:
            r["window"] = w
        results.append(r)
    results.sort(key=lambda r: -r["relevance_score"])  # stable: ties keep the request's order
    if body.top_n is not None:
        results = results[: body.top_n]
    tokens = scored.tokens if isinstance(scored, Windowed) else sum(scored.lengths)  # with windows: every window's
    meta = {
        "api_version": {"version": version},
        "billed_units": {"search_units": math.ceil(len(texts) / 100), "input_tokens": tokens},
        "tokens": {"input_tokens": tokens, "output_tokens": 0},
    }
    return JSONResponse(
        {
            "id": str(uuid.uuid4()),
            "model": scored.model,
            "results": results,
            "meta": meta,
            "usage": {"total_tokens": tokens},
        }
    )


DESCRIPTION = (
    "Cohere's rerank (also Jina's, vLLM's and Infinity's shape): the documents ranked for the query, best first. "
    f"`relevance_score` is {RELEVANCE}. `model` is {MODEL_NOTE}."
)


@router.post("/v1/rerank", response_model=CompatRerankResponse, responses=ERRORS, description=DESCRIPTION)
async def rerank_v1(
    body: CompatRerankRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    use_cache: UseCacheDep,
    timeout_ms: TimeoutHeader = None,
):
    return await rerank("1", body, request, engine, settings, metrics, timeout_ms, use_cache)


@router.post("/v2/rerank", response_model=CompatRerankResponse, responses=ERRORS, description=DESCRIPTION)
async def rerank_v2(
    body: CompatRerankRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    use_cache: UseCacheDep,
    timeout_ms: TimeoutHeader = None,
):
    return await rerank("2", body, request, engine, settings, metrics, timeout_ms, use_cache)


# --- /tokenize ---------------------------------------------------------------------------------
