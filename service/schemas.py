"""Request and response bodies. Types are strict: a number is not a title."""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

Text = Annotated[StrictStr, Field(min_length=1)]


def _blank(texts: list[str], what: str) -> None:
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"{what} {i} is empty or whitespace")


class Pair(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: Text
    title: Text


class ScoreRequest(BaseModel):
    """One query with many titles, or a list of pairs."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"query": "cordless drill", "titles": ["DEWALT 20V MAX Cordless Drill", "Garden hose 50 ft"]}]
        },
    )
    query: Text | None = None
    titles: list[Text] | None = Field(None, min_length=1)
    pairs: list[Pair] | None = Field(None, min_length=1)
    truncation: Literal["only_second", "longest_first"] = "only_second"
    return_probs: StrictBool = True
    top_n: StrictInt | None = Field(None, ge=1, description="return only the best n, sorted by score")

    @model_validator(mode="after")
    def _one_form(self) -> ScoreRequest:
        if self.pairs is not None:
            if self.query is not None or self.titles is not None:
                raise ValueError("give either `query` + `titles` or `pairs`, not both")
            _blank([p.query for p in self.pairs], "pairs query")
            _blank([p.title for p in self.pairs], "pairs title")
        else:
            if self.query is None or self.titles is None:
                raise ValueError("give `query` and `titles`, or `pairs`")
            _blank([self.query], "query")
            _blank(self.titles, "title")
        return self

    def as_pairs(self) -> tuple[list[str], list[str]]:
        if self.pairs is not None:
            return [p.query for p in self.pairs], [p.title for p in self.pairs]
        assert self.query is not None and self.titles is not None
        return [self.query] * len(self.titles), list(self.titles)


class ScoreResult(BaseModel):
    index: int = Field(description="position of the pair in the request")
    level: str = Field(description="most probable level (the checkpoint's label, 1..5 by default)")
    score: float = Field(description="expected level, sum of level x probability: ranks titles")
    probs: dict[str, float] | None = Field(None, description="probability per level")
    tokens: int = Field(description="tokens the pair used, special tokens included")
    truncated: bool


class ScoreResponse(BaseModel):
    model: str
    results: list[ScoreResult]


# --- text-embeddings-inference compatible ----------------------------------------------------
Direction = Literal["Right", "Left"]


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: list[Text] | list[list[Text]] = Field(description="one [query, title] pair or a list of them")
    raw_scores: StrictBool = False
    truncate: StrictBool | None = False
    truncation_direction: Direction = "Right"

    def _batch(self) -> list[list[str]]:
        """The inputs as a list of pairs, whichever of the two shapes was sent."""
        if self.inputs and isinstance(self.inputs[0], list):
            return self.inputs
        return [cast(list[str], self.inputs)]

    @model_validator(mode="after")
    def _pairs(self) -> PredictRequest:
        batch = self._batch()
        if not batch or not batch[0]:
            raise ValueError("inputs is empty")
        for i, p in enumerate(batch):
            if len(p) != 2:
                raise ValueError(f"input {i} must be a [query, title] pair, got {len(p)} texts")
            _blank(list(p), f"input {i} text")
        return self

    @property
    def single(self) -> bool:
        return not isinstance(self.inputs[0], list)

    def as_pairs(self) -> tuple[list[str], list[str]]:
        batch = self._batch()
        return [p[0] for p in batch], [p[1] for p in batch]


class Prediction(BaseModel):
    score: float
    label: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    query: Text
    texts: list[Text] = Field(min_length=1)
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool | None = False
    truncation_direction: Direction = "Right"

    @model_validator(mode="after")
    def _texts(self) -> RerankRequest:
        _blank([self.query], "query")
        _blank(self.texts, "text")
        return self


class Rank(BaseModel):
    index: int
    score: float = Field(description="expected level (or its logit-based value with raw_scores)")
    text: str | None = None


class ErrorBody(BaseModel):
    error: str
    error_type: str


class Info(BaseModel):
    model_id: str
    model_path: str
    levels: list[str]
    max_length: int
    device: str
    dtype: str
    version: str
    state: str
    model: dict = {}  # what the model says of itself: level rule and cut points, kernels
    worker: dict  # effective layout: mode, model processes (replicas), torch threads each, restarts, pids
    settings: dict
