"""Request and response bodies. Types are strict: a number is not a title.

The schema states what the server enforces. The limits that are settings mark their place with the Settings
field that holds them (`limited(maxLength="max_text_chars")`); service/openapi.py writes the effective value
there when the app serves its schema, and routes.check_limits enforces the same field (413). The rules the
validators below enforce (not blank, a pair is two texts, one form of the body) are stated beside them."""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema, WithJsonSchema

from service.http.cutoff import BELOW, MIN_LEVEL, Level, Score, min_score_doc

# JSON Schema keyword -> the Settings field whose value it takes (resolved by service/openapi.py)
LIMITS = "x-qtrel-limits"
TEXT_CHARS, PAIRS = "max_text_chars", "max_pairs_per_request"


def limited(**keywords: str) -> dict[str, Any]:
    return {LIMITS: keywords}


MODEL_FIELD = (
    "the served model to answer (GET /v1/models lists them); absent: the default. With one model served any "
    "name is accepted; with several, a name not served gets 404 model_not_found"
)
ModelName = Annotated[StrictStr, Field(min_length=1, max_length=256)]


# `_blank` refuses a text of nothing but str.isspace() characters (all of them are here; the schema test checks
# it): the pattern asks for one other character. Written out, so that ECMA and Python regexes read it alike.
NOT_BLANK = "[^\\u0009-\\u000d\\u001c-\\u0020\\u0085\\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"
Text = Annotated[
    StrictStr, Field(min_length=1, json_schema_extra={"pattern": NOT_BLANK, **limited(maxLength=TEXT_CHARS)})
]
Absent = SkipJsonSchema[None]  # optional, but never null in the schema: the server reads null as absent
PAIR = 2  # texts in a TEI input pair, [query, title]
QueryTitle = Annotated[list[Text], Field(json_schema_extra={"minItems": PAIR, "maxItems": PAIR})]


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# JSON Schema's "integer" holds 3.0 too (a JavaScript client may send it): taken as 3; "3", true and 3.5 are not.
WholeInt = Annotated[StrictInt, BeforeValidator(_integral)]
# The bound before the validator, so that the schema of an optional one states it
AtLeastOne = Annotated[StrictInt, Field(ge=1), BeforeValidator(_integral)]

# Long documents in windows (service/runtime/windows.py): off unless a request gives a number of windows.
Overlap = Annotated[StrictInt, Field(ge=0, le=512), BeforeValidator(_integral)]
MAX_CHUNKS = (
    "split each title longer than the model's window (what the query leaves of max_length) into at most this "
    "many overlapping windows of whole words, score each with the query and give the title its best window's "
    "scores; every window counts as a pair against max_pairs_per_request. Absent: titles are truncated"
)
OVERLAP = "tokens consecutive windows share (default: the chunk_overlap setting; at most half a window is used)"


PRIORITY = (
    "high (the default: interactive, always forwarded first) or low (forwarded only while no high-priority work "
    "waits, as score jobs are: it uses the capacity live traffic leaves, and may wait long under load); or an "
    "integer, as vLLM's and Cohere's priority: lower is earlier, 0 or less is high, above 0 is low"
)


def _priority(value: Any) -> Any:
    value = _integral(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return "high" if value <= 0 else "low"
    return value


Priority = Annotated[
    Literal["high", "low"],
    BeforeValidator(_priority),
    WithJsonSchema({"anyOf": [{"type": "string", "enum": ["high", "low"]}, {"type": "integer"}]}),
]


def check_windows(max_chunks: int | None, overlap: int | None, name: str = "max_chunks") -> None:
    if overlap is not None and max_chunks is None:
        raise ValueError(f"chunk_overlap applies to windows: give {name} too")


class WindowResult(BaseModel):
    index: int = Field(description="the winning window, 0-based in document order")
    count: int = Field(description="windows the document was scored in (1: it fitted in one)")
    start: int = Field(description="the window's character span in the document: text[start:end]")
    end: int


def one_of(single: tuple[str, ...], listed: str) -> list[JsonValue]:
    """The schema of "`single`'s fields, or `listed`, never both" (the validators' rule)."""
    return [
        {"required": [*single], "not": {"required": [listed]}},
        {"required": [listed], "not": {"anyOf": [{"required": [f]} for f in single]}},
    ]


def _blank(texts: list[str], what: str) -> None:
    for i, t in enumerate(texts):
        if not t.strip():
            raise ValueError(f"{what} {i} is empty or whitespace")


UNKNOWN_SHARE = (
    "share of the pair's word pieces (query and title, before truncation) that are the model's unknown token: "
    "text its vocabulary cannot read"
)
RAW_SCORES = (
    "score with the raw logit instead: a one-logit head's logit (its score is the sigmoid of it); a k-level "
    "head's top-level logit minus its lowest-level logit"
)


class Pair(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: Text
    title: Text


Titles = Annotated[list[Text], Field(min_length=1, json_schema_extra=limited(maxItems=PAIRS))]
Pairs = Annotated[list[Pair], Field(min_length=1, json_schema_extra=limited(maxItems=PAIRS))]


class ScoreRequest(BaseModel):
    """One query with many titles, or a list of pairs."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"query": "cordless drill", "titles": ["DEWALT 20V MAX Cordless Drill", "Garden hose 50 ft"]}],
            "oneOf": one_of(("query", "titles"), "pairs"),
            "dependentRequired": {"chunk_overlap": ["max_chunks"]},
        },
    )
    query: Text | Absent = None
    titles: Titles | Absent = None
    pairs: Pairs | Absent = None
    truncation: Literal["only_second", "longest_first"] = "only_second"
    return_probs: StrictBool = True
    raw_scores: StrictBool = Field(False, description=RAW_SCORES)
    top_n: AtLeastOne | None = Field(None, description="return only the best n, sorted by score")
    max_chunks: AtLeastOne | None = Field(None, description=MAX_CHUNKS)
    chunk_overlap: Overlap | None = Field(None, description=OVERLAP)
    model: ModelName | Absent = Field(None, description=MODEL_FIELD)
    priority: Priority = Field("high", description=PRIORITY)
    min_level: Level | None = Field(None, description=MIN_LEVEL)
    min_score: Score | None = Field(None, description=min_score_doc("score (the expected level)"))

    @model_validator(mode="after")
    def _one_form(self) -> ScoreRequest:
        check_windows(self.max_chunks, self.chunk_overlap)
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
    level: str = Field(description="the level the checkpoint's level rule grades (its labels; GET /info lists them)")
    score: float = Field(
        description="expected level, sum of level x probability: ranks titles (a one-logit head: the sigmoid of its "
        "logit, 0..1; with raw_scores, the raw logit)"
    )
    probs: dict[str, float] | None = Field(None, description="probability per level")
    tokens: int = Field(description="tokens the pair used, special tokens included")
    truncated: bool
    unknown_share: float = Field(0.0, description=UNKNOWN_SHARE)
    window: WindowResult | None = Field(None, description="with max_chunks: the window whose scores these are")


class ScoreResponse(BaseModel):
    model: str = Field(description="the served model that answered")
    results: list[ScoreResult]
    below_cutoff: int | None = Field(None, description=BELOW)
    warnings: list[str] | None = Field(None, description="pairs the model mostly cannot read (unknown_share_warn)")


# --- text-embeddings-inference compatible ----------------------------------------------------
Direction = Literal["Right", "Left"]


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: (
        QueryTitle | Annotated[list[QueryTitle], Field(json_schema_extra={"minItems": 1, **limited(maxItems=PAIRS)})]
    ) = Field(description="one [query, title] pair or a list of them")
    raw_scores: StrictBool = False
    truncate: StrictBool | None = False
    truncation_direction: Direction = "Right"
    priority: Priority = Field("high", description=PRIORITY)

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
            if len(p) != PAIR:
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
    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"dependentRequired": {"chunk_overlap": ["max_chunks"]}}
    )
    query: Text
    texts: Titles
    raw_scores: StrictBool = Field(False, description=RAW_SCORES)
    return_text: StrictBool = False
    truncate: StrictBool | None = False
    truncation_direction: Direction = "Right"
    max_chunks: AtLeastOne | None = Field(None, description=MAX_CHUNKS + " (qtrel's, not TEI's)")
    chunk_overlap: Overlap | None = Field(None, description=OVERLAP)
    priority: Priority = Field("high", description=PRIORITY)
    min_level: Level | None = Field(None, description=MIN_LEVEL + " (qtrel's, not TEI's)")
    min_score: Score | None = Field(None, description=min_score_doc("score (the expected level)") + " (qtrel's)")

    @model_validator(mode="after")
    def _texts(self) -> RerankRequest:
        check_windows(self.max_chunks, self.chunk_overlap)
        _blank([self.query], "query")
        _blank(self.texts, "text")
        return self


class Rank(BaseModel):
    index: int
    score: float = Field(description="expected level (or its logit-based value with raw_scores)")
    unknown_share: float = Field(0.0, description=UNKNOWN_SHARE + " (qtrel's, not TEI's)")
    text: str | None = None
    window: WindowResult | None = Field(None, description="with max_chunks: the window whose score this is")


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
    job_processes: dict | None = None  # where score jobs' batches run (idle: their own processes); None: jobs off
    cache: dict = {}  # the pair-score cache: on or off, its bound, bytes and entries held, the model generation
    models: list[dict] = []  # every served model as GET /v1/models lists it, with its share of the cores
    shadow: dict | None = None  # the shadow model and its sampling, when one is set
    fronts: dict = {}  # the HTTP front processes: how many (http_workers), why, their socket, pids, restarts
    settings: dict
