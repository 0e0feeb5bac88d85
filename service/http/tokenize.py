"""`POST /tokenize` (text-embeddings-inference's route, with more): each pair as the model sees it and
what truncation kept and cut, as the model's tokenizer reports it. No forward pass."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.http.deps import EngineDep, SettingsDep
from service.http.routes import ERRORS, check_limits
from service.http.schemas import MODEL_FIELD, Absent, Direction, ModelName, Pairs, Text, one_of

router = APIRouter(tags=["text-embeddings-inference"])


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
    model: ModelName | Absent = Field(None, description=MODEL_FIELD)

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


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
async def tokenize(body: TokenizeRequest, engine: EngineDep, settings: SettingsDep):
    """The tokens of each pair as the model sees them (its tokenizer's frame: `[CLS] query [SEP] title [SEP]`
    with segment ids 0/1 for BERT, `<s> query </s></s> title </s>` for XLM-R) and
    what truncation cut: how many word pieces of the query and the title were kept, which were dropped and from
    which end. No forward pass."""
    queries, titles = body.as_pairs()
    check_limits(settings, queries, titles)
    side = body.truncation_direction.lower()
    t = await engine.tokenize(queries, titles, truncation=body.truncation, side=side, model=body.model)
    results = []
    for i, (ids, segs, toks, cut) in enumerate(zip(t.enc.input_ids, t.enc.token_type_ids, t.tokens, t.cuts)):
        specials = set(cut.specials)
        results.append(
            {
                "index": i,
                "length": len(ids),
                "truncated": cut.truncated,
                "cut_from": ("end" if side == "right" else "start") if cut.truncated else None,
                "query": {
                    "tokens": len(cut.query),
                    "kept": len(cut.query_kept),
                    "dropped": t.pieces(cut.dropped(cut.query, cut.query_kept)),
                },
                "title": {
                    "tokens": len(cut.title),
                    "kept": len(cut.title_kept),
                    "dropped": t.pieces(cut.dropped(cut.title, cut.title_kept)),
                },
                "tokens": [
                    {"id": x, "text": s, "segment": g, "special": j in specials}
                    for j, (x, s, g) in enumerate(zip(ids, toks, segs))
                ],
                "input_ids": ids,
                "token_type_ids": segs,
            }
        )
    return JSONResponse({"model": t.model, "max_length": t.max_length, "results": results})
