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
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from model.scoring import level_values
from service.deps import EngineDep, MetricsDep, SettingsDep, TimeoutHeader
from service.routes import ERRORS, check_limits, score_watched
from service.schemas import PAIRS, Absent, AtLeastOne, Direction, Pairs, Text, limited, one_of

router = APIRouter(tags=["rerank (Cohere, Jina)"])

RELEVANCE = (
    "the expected level mapped onto 0..1: (E - lo) / (hi - lo) for the model's lowest and highest level values, "
    "(E - 1) / (k - 1) for levels 1..k; ranks as /score's `score`"
)
MODEL_NOTE = (
    "accepted and not checked: Cohere's clients always send one. The served model answers whatever is named; "
    "the response's `model` says which it was"
)


class Document(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere v1 lets a document carry other fields; only `text` is read
    text: Text


class CompatRerankRequest(BaseModel):
    """Cohere's rerank request. Other fields Cohere's SDK sends (rank_fields, max_chunks_per_doc,
    relevant_spans, priority, ...) are accepted and ignored."""

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
            ]
        },
    )
    model: str | None = Field(None, description=MODEL_NOTE)
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

    @model_validator(mode="after")
    def _not_blank(self) -> CompatRerankRequest:
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


class CompatRerankResponse(BaseModel):
    id: str
    model: str = Field(description="the model that scored (whatever the request named)")
    results: list[CompatRerankResult] = Field(description="best first")
    meta: dict[str, Any] = Field(
        description="Cohere's api_version, billed_units (search_units: one per 100 documents, input_tokens) and tokens"
    )
    usage: dict[str, int] = Field(description="Jina's and vLLM's: total_tokens")


def relevance(expected: float, lo: float, hi: float) -> float:
    """The expected level on 0..1 (1.0 when the model has a single level value)."""
    if hi <= lo:
        return 1.0
    return min(1.0, max(0.0, (expected - lo) / (hi - lo)))


async def rerank(
    version: str,
    body: CompatRerankRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    timeout_ms: int | None,
) -> JSONResponse:
    texts = body.texts()
    scored = await score_watched(request, engine, settings, metrics, [body.query] * len(texts), texts, timeout_ms)
    values = level_values(scored.labels).tolist()
    lo, hi = min(values), max(values)
    results: list[dict[str, Any]] = []
    for i, out in enumerate(scored.outputs):
        r: dict[str, Any] = {"index": i, "relevance_score": relevance(out.expected, lo, hi)}
        if body.return_documents:
            r["document"] = {"text": texts[i]}
        results.append(r)
    results.sort(key=lambda r: -r["relevance_score"])  # stable: ties keep the request's order
    if body.top_n is not None:
        results = results[: body.top_n]
    tokens = sum(scored.enc.lengths)
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
    timeout_ms: TimeoutHeader = None,
):
    return await rerank("1", body, request, engine, settings, metrics, timeout_ms)


@router.post("/v2/rerank", response_model=CompatRerankResponse, responses=ERRORS, description=DESCRIPTION)
async def rerank_v2(
    body: CompatRerankRequest,
    request: Request,
    engine: EngineDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    timeout_ms: TimeoutHeader = None,
):
    return await rerank("2", body, request, engine, settings, metrics, timeout_ms)


# --- /tokenize ---------------------------------------------------------------------------------
class TokenizeRequest(BaseModel):
    """One pair, or a list of pairs, with the truncation options /score and /predict take."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"query": "cordless drill", "title": "DEWALT 20V MAX Cordless Drill"}],
            "oneOf": one_of(("query", "title"), "pairs"),
        },
    )
    query: Text | Absent = None
    title: Text | Absent = None
    pairs: Pairs | Absent = None
    truncation: Literal["only_second", "longest_first"] = Field(
        "only_second", description="only_second (/score's default): cut the title, keep the query whole"
    )
    truncation_direction: Direction = Field("Right", description="which end of a text is cut: Right cuts its end")

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        single = self.query is not None or self.title is not None
        if single == (self.pairs is not None):
            raise ValueError("give either `query` + `title` or `pairs`")
        for what, texts in (("query", self.as_pairs()[0]), ("title", self.as_pairs()[1])):
            for i, t in enumerate(texts):
                if t is None or not t.strip():
                    raise ValueError(f"{what} {i} is missing, empty or whitespace")
        return self

    def as_pairs(self) -> tuple[list[str], list[str]]:
        if self.pairs is not None:
            return [p.query for p in self.pairs], [p.title for p in self.pairs]
        return [self.query], [self.title]  # type: ignore[list-item]  # None is refused by _one_form


class Token(BaseModel):
    id: int
    text: str
    segment: int = Field(description="0 query, 1 title (the token type id)")
    special: bool


class TextCut(BaseModel):
    tokens: int = Field(description="word pieces of the text before truncation, special tokens excluded")
    kept: int
    dropped: list[str] = Field(description="the word pieces truncation removed, in text order")


class TokenizedPair(BaseModel):
    index: int
    length: int = Field(description="tokens the model sees, special tokens included")
    truncated: bool
    cut_from: Literal["end", "start"] | None = Field(
        description="which end of a text lost tokens; null when nothing was cut"
    )
    query: TextCut
    title: TextCut
    tokens: list[Token]
    input_ids: list[int]
    token_type_ids: list[int]


class TokenizeResponse(BaseModel):
    model: str
    max_length: int = Field(description="the model's limit for a pair, special tokens included")
    results: list[TokenizedPair]


def text_cut(full: list[str], kept: int, side: str) -> dict[str, Any]:
    dropped = full[kept:] if side == "right" else full[: len(full) - kept]
    return {"tokens": len(full), "kept": kept, "dropped": dropped}


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS, tags=["text-embeddings-inference"])
async def tokenize(body: TokenizeRequest, engine: EngineDep, settings: SettingsDep):
    """The tokens of each pair as the model sees them (`[CLS] query [SEP] title [SEP]`, segment ids 0/1) and
    what truncation cut: how many word pieces of the query and the title were kept, which were dropped and from
    which end. No forward pass."""
    queries, titles = body.as_pairs()
    check_limits(settings, queries, titles)
    side = body.truncation_direction.lower()
    t = await engine.tokenize(queries, titles, truncation=body.truncation, side=side)
    results = []
    for i, (ids, segs, toks, cut) in enumerate(zip(t.enc.input_ids, t.enc.token_type_ids, t.tokens, t.enc.truncated)):
        n_query = segs.count(0) - 2  # [CLS] and the first [SEP] are segment 0
        specials = {0, n_query + 1, len(ids) - 1}
        results.append(
            {
                "index": i,
                "length": len(ids),
                "truncated": cut,
                "cut_from": ("end" if side == "right" else "start") if cut else None,
                "query": text_cut(t.query_tokens[i], n_query, side),
                "title": text_cut(t.title_tokens[i], len(ids) - n_query - 3, side),
                "tokens": [
                    {"id": x, "text": s, "segment": g, "special": j in specials}
                    for j, (x, s, g) in enumerate(zip(ids, toks, segs))
                ],
                "input_ids": ids,
                "token_type_ids": segs,
            }
        )
    return JSONResponse({"model": t.model, "max_length": t.max_length, "results": results})
