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
from pydantic import BaseModel, ConfigDict, Field, JsonValue, PrivateAttr, StrictBool, model_validator

from model.levels import unit_score
from service.http import cutoff
from service.http.deps import EngineDep, MetricsDep, SettingsDep, TimeoutHeader, UseCacheDep
from service.http.documents import DOCUMENTS, RANK_FIELDS, Document, RankFields, echoed, title_of
from service.http.priority import OPENAPI as PRIORITY_HEADER
from service.http.priority import priority_of
from service.http.routes import ERRORS, score_watched, unread_warning, window_of
from service.http.schemas import (
    MAX_CHUNKS,
    NOT_BLANK,
    OVERLAP,
    PAIRS,
    PRIORITY,
    TEXT_CHARS,
    UNKNOWN_SHARE,
    AtLeastOne,
    Overlap,
    Priority,
    Text,
    WindowResult,
    check_windows,
    limited,
)

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


TEXT_OBJECT: dict[str, JsonValue] = {
    "type": "object",
    "required": ["text"],
    "properties": {"text": {"type": "string", "minLength": 1, "pattern": NOT_BLANK, **limited(maxLength=TEXT_CHARS)}},
}


class CompatRerankRequest(BaseModel):
    """Cohere's rerank request. Other fields Cohere's SDK sends (relevant_spans, ...) are accepted
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
            # without rank_fields, an object document is scored by its `text`, which is then a Text
            "if": {"not": {"required": ["rank_fields"]}},
            "then": {"properties": {"documents": {"items": {"anyOf": [{"type": "string"}, TEXT_OBJECT]}}}},
        },
    )
    model: str | None = Field(None, description=MODEL_NOTE)
    priority: Priority = Field("high", description=PRIORITY)
    query: Text
    documents: list[Text | Document] = Field(
        min_length=1, description=DOCUMENTS, json_schema_extra=limited(maxItems=PAIRS)
    )
    rank_fields: RankFields | None = Field(None, description=RANK_FIELDS)
    top_n: AtLeastOne | None = Field(None, description="return only the best n (all when absent)")
    return_documents: StrictBool = Field(
        False, description="add each result's `document`: `{text}` for a string, an object as it was sent"
    )
    max_tokens_per_doc: AtLeastOne | None = Field(
        None,
        description="accepted; not applied: a pair is cut to the model's max_length tokens (only the "
        "title is cut, see /tokenize)",
    )
    max_chunks_per_doc: AtLeastOne | None = Field(None, description=MAX_CHUNKS.replace("title", "document"))
    chunk_overlap: Overlap | None = Field(None, description=OVERLAP + " (qtrel's, not Cohere's)")
    min_level: cutoff.Level | None = Field(None, description=cutoff.MIN_LEVEL + " (qtrel's)")
    min_score: cutoff.UnitScore | None = Field(
        None, description=cutoff.min_score_doc("relevance_score (0..1)") + " (qtrel's)"
    )
    _titles: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _not_blank(self) -> CompatRerankRequest:
        check_windows(self.max_chunks_per_doc, self.chunk_overlap, "max_chunks_per_doc")
        if not self.query.strip():
            raise ValueError("query is empty or whitespace")
        self._titles = [title_of(d, i, self.rank_fields) for i, d in enumerate(self.documents)]
        for i, t in enumerate(self._titles):
            if not t.strip():
                raise ValueError(f"document {i} is empty or whitespace")
        return self

    def texts(self) -> list[str]:
        """The text scored for each document (documents.title_of)."""
        return self._titles


class CompatRerankResult(BaseModel):
    index: int = Field(description="position of the document in the request")
    relevance_score: float = Field(description=RELEVANCE)
    id: JsonValue = Field(None, description="the document's `id`, where it is an object that has one (qtrel's)")
    document: dict[str, JsonValue] | None = Field(
        None, description="only with return_documents: `{text}` for a string document, an object as it was sent"
    )
    unknown_share: float = Field(0.0, description=UNKNOWN_SHARE + " (qtrel's, not Cohere's)")
    window: WindowResult | None = Field(
        None, description="with max_chunks_per_doc: the window whose score this is (qtrel's, not Cohere's)"
    )


class CompatRerankResponse(BaseModel):
    id: str
    model: str = Field(description="the served model that scored")
    results: list[CompatRerankResult] = Field(description="best first")
    meta: dict[str, Any] = Field(
        description="Cohere's api_version, billed_units (search_units: one per 100 documents, input_tokens) and "
        "tokens; warnings: documents the model mostly cannot read (unknown_share_warn)"
    )
    usage: dict[str, int] = Field(description="Jina's and vLLM's: total_tokens")
    below_cutoff: int | None = Field(None, description=cutoff.BELOW + " (qtrel's)")


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
        priority=priority_of(body, request),
    )
    floor = cutoff.level_floor(body.min_level, scored.labels, scored.model)
    results: list[dict[str, Any]] = []
    below = 0
    for i, out in enumerate(scored.outputs):
        relevance = unit_score(out.expected, scored.labels)
        if not cutoff.kept(out.level, relevance, floor, body.min_score):
            below += 1
            continue
        r: dict[str, Any] = {"index": i, "relevance_score": relevance, "unknown_share": round(scored.unknown[i], 4)}
        doc = body.documents[i]
        if isinstance(doc, dict) and "id" in doc:
            r["id"] = doc["id"]
        if body.return_documents:
            r["document"] = echoed(doc)
        if (w := window_of(scored, i)) is not None:
            r["window"] = w
        results.append(r)
    results.sort(key=lambda r: -r["relevance_score"])  # stable: ties keep the request's order
    if body.top_n is not None:
        results = results[: body.top_n]
    tokens = scored.tokens  # with windows: every window's
    meta = {
        "api_version": {"version": version},
        "billed_units": {"search_units": math.ceil(len(texts) / 100), "input_tokens": tokens},
        "tokens": {"input_tokens": tokens, "output_tokens": 0},
    }
    if warning := unread_warning(scored, settings):
        meta["warnings"] = [warning]  # Cohere's own place for them
    answer: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "model": scored.model,
        "results": results,
        "meta": meta,
        "usage": {"total_tokens": tokens},
    }
    if floor is None and body.min_score is None:
        return JSONResponse(answer)
    answer["below_cutoff"] = below
    return JSONResponse(answer, headers={cutoff.HEADER: str(below)})


DESCRIPTION = (
    "Cohere's rerank (also Jina's, vLLM's and Infinity's shape): the documents ranked for the query, best first. "
    f"`relevance_score` is {RELEVANCE}. `model` is {MODEL_NOTE}."
)


@router.post(
    "/v1/rerank",
    response_model=CompatRerankResponse,
    responses=ERRORS,
    description=DESCRIPTION,
    openapi_extra=PRIORITY_HEADER,
)
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


@router.post(
    "/v2/rerank",
    response_model=CompatRerankResponse,
    responses=ERRORS,
    description=DESCRIPTION,
    openapi_extra=PRIORITY_HEADER,
)
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
