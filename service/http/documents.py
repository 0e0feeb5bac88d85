"""Documents as Cohere's v1 rerank takes them: strings, `{"text": ...}`, or objects with an `id` and fields of
which `rank_fields` names those that form the title the model scores.

The title of an object: its `text` field without `rank_fields`; with one rank field, that field's value alone
(`rank_fields: ["title"]` scores exactly as sending the title as a string: the built-in models learnt bare
product titles); with several, one `name: value` line per field in the order given
(`"title: X\\nbrand: Y"`), a field that is empty or whitespace left out. The object itself is never changed:
`return_documents` echoes it as sent, `id` and every other field included."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, JsonValue, StrictStr

MAX_RANK_FIELDS = 32
Document = dict[str, JsonValue]
RankFields = Annotated[
    list[Annotated[StrictStr, Field(min_length=1, max_length=256)]],
    Field(min_length=1, max_length=MAX_RANK_FIELDS),
]
DOCUMENTS = (
    'strings, or objects: `{"text": ...}`, or any fields (an `id`, metadata) with `rank_fields` naming those '
    "that form the title; objects are echoed back untouched with return_documents"
)
RANK_FIELDS = (
    "the fields of object documents that form the title, in order: one field is scored as its value alone, "
    'several as "name: value" lines ("title: X\\nbrand: Y"), empty ones left out. Every object must have each '
    "field, as a string. Absent: the `text` field. String documents are scored as they are"
)


def title_of(doc: str | Document, i: int, rank_fields: list[str] | None) -> str:
    """The text scored for document i; ValueError (a 422) naming the document and field for a bad shape."""
    if isinstance(doc, str):
        return doc
    fields = rank_fields or ["text"]
    values = []
    for name in fields:
        if name not in doc:
            hint = "" if rank_fields else " (or give rank_fields to rank it by other fields)"
            raise ValueError(f"document {i} has no `{name}` field{hint}")
        value = doc[name]
        if not isinstance(value, str):
            raise ValueError(f"document {i}: field `{name}` must be a string, not {_json_type(value)}")
        values.append(value)
    if len(fields) == 1:
        return values[0]
    return "\n".join(f"{name}: {v}" for name, v in zip(fields, values) if v.strip())


def echoed(doc: str | Document) -> Document:
    """What return_documents gives back: `{"text": s}` for a string, an object as it was sent."""
    return {"text": doc} if isinstance(doc, str) else doc


def _json_type(value: JsonValue) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "an array" if isinstance(value, list) else "an object"
