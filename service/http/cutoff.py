"""The calibrated cut-off: `min_level` and `min_score` on the scoring routes. A result below either is left
out of the answer, and the answer says how many were (`below_cutoff` in the body where the body is an object,
the `X-Below-Cutoff` header on every route). What a level and a score mean on the built-in models, measured,
is in docs/model-card.md ("Choosing a cut-off")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import BeforeValidator, Field, StrictFloat, StrictStr, WithJsonSchema

from service.errors import ErrorKind, ServiceError

HEADER = "X-Below-Cutoff"
MIN_LEVEL = (
    'leave out results graded below this level (a level of the model, e.g. 4 or "4"; levels are ordered as '
    "the model lists them); the count left out is returned"
)
BELOW = "results left out by min_level / min_score (present only when one is given); top_n applies after them"


def _level_text(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# A level is its label; a whole number stands for the label it spells (4 -> "4")
Level = Annotated[
    StrictStr,
    BeforeValidator(_level_text),
    Field(min_length=1, max_length=64),
    WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1, "maxLength": 64}, {"type": "integer"}]}),
]
Score = Annotated[StrictFloat, Field(allow_inf_nan=False)]  # a whole number is a float too
UnitScore = Annotated[StrictFloat, Field(ge=0, le=1, allow_inf_nan=False)]  # on Cohere's relevance_score


def min_score_doc(scale: str) -> str:
    return f"leave out results whose {scale} is below this; the count left out is returned"


def level_floor(min_level: str | int | None, labels: Sequence[str], model: str) -> int | None:
    """The class index of `min_level` in the model's levels; a level the model does not have is a 422."""
    if min_level is None:
        return None
    try:
        return list(labels).index(str(min_level))
    except ValueError:
        levels = ", ".join(labels)
        raise ServiceError(
            ErrorKind.VALIDATION, f"min_level {min_level!r} is not a level of {model}: its levels are {levels}"
        ) from None


def kept(level: int, score: float, floor: int | None, min_score: float | None) -> bool:
    return (floor is None or level >= floor) and (min_score is None or score >= min_score)
