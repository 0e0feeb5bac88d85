"""The OpenAPI schema tells the truth: every scoring route's schema states the limits the server enforces,
with the effective settings' values, and at the limits the schema and a live server (tiny checkpoint) agree:
what the schema accepts is served, one text character or one pair over is refused with 413, and the rules of
the validators (not blank, a pair is two texts, one form of the body) are refused by both."""

from __future__ import annotations

import json
import sys

import httpx
import jsonschema
import pytest

from service.app import create_app
from service.http.schemas import LIMITS, NOT_BLANK
from service.settings import Settings
from tests.service.conftest import live_server

CHARS, PAIRS = 50, 10
ROUTES = ["/score", "/predict", "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize", "/explain"]


def text(n: int) -> str:
    return ("cordless drill bit set " * 10)[:n]


def at_limit(path: str, chars: int = CHARS, pairs: int = PAIRS) -> dict:
    """A body with `pairs` pairs (one for /explain) whose every text has `chars` characters."""
    q, ts = text(chars), [text(chars)] * pairs
    return {
        "/score": {"query": q, "titles": ts},
        "/predict": {"inputs": [[q, t] for t in ts]},
        "/rerank": {"query": q, "texts": ts},
        "/v1/rerank": {"query": q, "documents": ts},
        "/v2/rerank": {"query": q, "documents": [{"text": t} for t in ts]},
        "/tokenize": {"pairs": [{"query": q, "title": t} for t in ts]},
        "/explain": {"query": q, "title": ts[0]},
    }[path]


def body_validator(spec: dict, path: str) -> jsonschema.Draft202012Validator:
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return jsonschema.Draft202012Validator({"$ref": ref, "components": spec["components"]})


def walk(node, found: list[dict]) -> list[dict]:
    """Every schema object under `node`."""
    if isinstance(node, dict):
        found.append(node)
        for v in node.values():
            walk(v, found)
    elif isinstance(node, list):
        for v in node:
            walk(v, found)
    return found


def served_schema(settings: Settings) -> dict:
    spec = create_app(settings).openapi()
    if f'"{LIMITS}"' in json.dumps(spec):
        pytest.fail(
            "the schema's limits are unresolved: create_app must call service.http.openapi.install(app, settings)"
        )
    return spec


@pytest.fixture(scope="module")
def spec(tiny_checkpoint) -> dict:
    s = Settings(model=str(tiny_checkpoint), max_text_chars=CHARS, max_pairs_per_request=PAIRS, max_body_bytes=9999)
    return served_schema(s)


@pytest.fixture(scope="module")
def limited_server(tiny_checkpoint):
    with live_server(
        tiny_checkpoint, max_wait_ms=5, replicas=1, max_text_chars=CHARS, max_pairs_per_request=PAIRS
    ) as srv:
        yield srv


def test_every_text_and_list_of_the_scoring_routes_carries_the_settings_limits(spec):
    schemas = spec["components"]["schemas"]
    # pydantic writes a bound it could not translate as its own keyword: JSON Schema tools ignore it
    assert not [s for s in walk(spec, []) if s.get("type") and {"ge", "gt", "le", "lt"} & set(s)]
    texts = [s for s in walk(schemas, []) if s.get("pattern") == NOT_BLANK]
    assert len(texts) >= 12 and all(s["maxLength"] == CHARS and s["minLength"] == 1 for s in texts)
    score = schemas["ScoreRequest"]
    assert score["properties"]["titles"]["maxItems"] == PAIRS and score["properties"]["pairs"]["maxItems"] == PAIRS
    assert score["properties"]["titles"]["minItems"] == 1
    assert score["properties"]["truncation"]["enum"] == ["only_second", "longest_first"]
    assert [b["required"] for b in score["oneOf"]] == [["query", "titles"], ["pairs"]]
    single, batch = schemas["PredictRequest"]["properties"]["inputs"]["anyOf"]
    assert (single["minItems"], single["maxItems"]) == (2, 2) and (batch["minItems"], batch["maxItems"]) == (1, PAIRS)
    assert (batch["items"]["minItems"], batch["items"]["maxItems"]) == (2, 2)
    assert schemas["PredictRequest"]["properties"]["truncation_direction"]["enum"] == ["Right", "Left"]
    assert schemas["RerankRequest"]["properties"]["texts"]["maxItems"] == PAIRS
    assert schemas["CompatRerankRequest"]["properties"]["documents"]["maxItems"] == PAIRS
    assert schemas["TokenizeRequest"]["properties"]["pairs"]["maxItems"] == PAIRS
    assert schemas["ExplainRequest"]["properties"]["top_heads"]["maximum"] == 64
    for path in ROUTES:
        too_large = spec["paths"][path]["post"]["responses"]["413"]["description"]
        assert f"over {CHARS} characters" in too_large and f"more than {PAIRS} pairs" in too_large
        assert "9999 bytes" in too_large


def test_the_schema_follows_the_effective_settings(tiny_checkpoint):
    small = served_schema(Settings(model=str(tiny_checkpoint), max_text_chars=7, max_pairs_per_request=3))
    default = served_schema(Settings(model=str(tiny_checkpoint)))
    for spec, chars, pairs in ((small, 7, 3), (default, 2000, 2048)):
        score = spec["components"]["schemas"]["ScoreRequest"]["properties"]
        assert score["query"]["maxLength"] == chars and score["titles"]["items"]["maxLength"] == chars
        assert score["titles"]["maxItems"] == pairs


def test_the_not_blank_pattern_is_what_the_server_calls_blank():
    """The pattern's class is exactly the characters str.strip() removes, so that schema and server agree."""
    import re

    blank = {chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()}
    assert {c for c in blank if not re.search(NOT_BLANK, c)} == blank
    assert all(re.search(NOT_BLANK, c) for c in ("a", "\u200b", "\ufeff", "0", "-"))


@pytest.mark.parametrize("path", ROUTES)
def test_at_the_limits_schema_valid_bodies_are_served_and_one_over_is_refused_413(limited_server, spec, path):
    valid = body_validator(spec, path)
    overs = [at_limit(path, chars=CHARS + 1, pairs=1)]
    if path != "/explain":
        overs.append(at_limit(path, pairs=PAIRS + 1))
    ok = at_limit(path)
    assert valid.is_valid(ok)
    r = httpx.post(limited_server.url + path, json=ok, timeout=60)
    assert r.status_code == 200, r.text
    for over in overs:
        assert not valid.is_valid(over)
        r = httpx.post(limited_server.url + path, json=over, timeout=60)
        assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large", r.text


# (route, body, accepted): the rules the validators enforce, stated by the schema too.
AGREE = [
    ("/score", {"query": "q", "titles": ["t"]}, True),
    ("/score", {"pairs": [{"query": "q", "title": "t"}], "truncation": "longest_first", "top_n": 1}, True),
    ("/score", {"query": "q", "titles": [" \t"]}, False),
    ("/score", {"query": "\x1c\u3000", "titles": ["t"]}, False),
    ("/score", {"query": "\u200b", "titles": ["t"]}, True),
    ("/score", {"query": "q", "titles": ["t"], "pairs": [{"query": "q", "title": "t"}]}, False),
    ("/score", {"query": "q", "pairs": [{"query": "q", "title": "t"}]}, False),
    ("/score", {"titles": ["t"]}, False),
    ("/score", {"query": "q", "titles": []}, False),
    ("/score", {"query": "q", "titles": ["t"], "truncation": "middle"}, False),
    ("/score", {"query": "q", "titles": ["t"], "extra": 1}, False),
    ("/score", {"query": "q", "titles": ["t"], "top_n": 2.0}, True),  # JSON Schema's integer holds 2.0
    ("/score", {"query": "q", "titles": ["t"], "top_n": 2.5}, False),
    ("/score", {"query": "q", "titles": ["t"], "top_n": "2"}, False),
    ("/score", {"query": "q", "titles": ["t"], "max_chunks": 2, "chunk_overlap": 4}, True),
    ("/score", {"query": "q", "titles": ["t"], "chunk_overlap": 4}, False),  # windows need max_chunks
    ("/score", {"query": "q", "titles": ["t"], "max_chunks": 0}, False),
    ("/score", {"query": "q", "titles": ["t"], "max_chunks": 1, "chunk_overlap": 513}, False),
    ("/predict", {"inputs": ["q", "t"]}, True),
    ("/predict", {"inputs": [["q", "t"]], "truncation_direction": "Left"}, True),
    ("/predict", {"inputs": []}, False),
    ("/predict", {"inputs": ["q"]}, False),
    ("/predict", {"inputs": [["q", "t", "u"]]}, False),
    ("/predict", {"inputs": [["q", " "]]}, False),
    ("/predict", {"inputs": [["q", "t"]], "truncation_direction": "Up"}, False),
    ("/rerank", {"query": "q", "texts": ["t", "u"]}, True),
    ("/rerank", {"query": "q", "texts": []}, False),
    ("/rerank", {"query": "q", "texts": ["t"], "max_chunks": 3}, True),
    ("/rerank", {"query": "q", "texts": ["t"], "chunk_overlap": 3}, False),
    ("/v1/rerank", {"query": "q", "documents": ["t"], "max_chunks_per_doc": 3, "chunk_overlap": 0}, True),
    ("/v2/rerank", {"query": "q", "documents": ["t"], "chunk_overlap": 3}, False),
    ("/v2/rerank", {"query": "q", "documents": ["t"], "max_chunks_per_doc": 0}, False),
    ("/v1/rerank", {"query": "q", "documents": ["t", {"text": "u", "id": 7}], "model": "x"}, True),
    ("/v1/rerank", {"query": "q", "documents": [{"text": "\n"}]}, False),
    ("/v2/rerank", {"query": "q", "documents": ["t"], "top_n": 1.0, "max_tokens_per_doc": 24872.0}, True),
    ("/v2/rerank", {"query": "q", "documents": [{"title": "no text"}]}, False),
    ("/v2/rerank", {"query": "q", "documents": [{"title": "t", "id": 3}], "rank_fields": ["title"]}, True),
    ("/v1/rerank", {"query": "q", "documents": [{"text": 5}]}, False),
    ("/v1/rerank", {"query": "q", "documents": ["t"], "rank_fields": []}, False),
    ("/score", {"query": "q", "titles": ["t"], "min_level": 4, "min_score": 3.5}, True),
    ("/score", {"query": "q", "titles": ["t"], "min_level": True}, False),
    ("/v1/rerank", {"query": "q", "documents": ["t"], "min_score": 1.5}, False),
    ("/tokenize", {"query": "q", "title": "t"}, True),
    ("/tokenize", {"query": "q"}, False),
    ("/tokenize", {"query": "q", "title": "t", "pairs": [{"query": "q", "title": "t"}]}, False),
    ("/explain", {"query": "q", "title": "t", "top_heads": 3}, True),
    ("/explain", {"query": "q", "title": "t", "top_heads": 65}, False),
    ("/explain", {"query": "q", "title": "t", "top_heads": 20.0}, True),
]


def test_the_schema_and_the_server_agree_on_the_validation_rules(limited_server, spec):
    for path, body, accepted in AGREE:
        assert body_validator(spec, path).is_valid(body) == accepted, (path, body)
        r = httpx.post(limited_server.url + path, json=body, timeout=60)
        assert (r.status_code == 200) == accepted, (path, body, r.status_code, r.text)
        if not accepted:
            assert r.status_code == 422 and r.json()["error_type"] == "validation", (path, body, r.text)


def test_the_timeout_header_is_an_integer_never_null(limited_server, spec):
    """A header has no null: a schema that allowed one had fuzzers send the text "null"."""
    (header,) = [p for p in spec["paths"]["/score"]["post"]["parameters"] if p["name"] == "X-Request-Timeout-Ms"]
    assert header["schema"]["type"] == "integer" and "anyOf" not in header["schema"]
    assert (header["schema"]["exclusiveMinimum"], header["schema"]["maximum"]) == (0, 3_600_000)
    body = at_limit("/score", pairs=1)
    for value, status in (("5000", 200), ("null", 422), ("0", 422)):
        r = httpx.post(limited_server.url + "/score", json=body, headers={"X-Request-Timeout-Ms": value})
        assert r.status_code == status, (value, r.text)


def test_every_scoring_route_states_the_cache_control_header(limited_server, spec):
    for path in ROUTES[:5]:
        (header,) = [p for p in spec["paths"][path]["post"]["parameters"] if p["name"] == "Cache-Control"]
        assert header["in"] == "header" and not header.get("required"), path
        assert header["schema"]["type"] == "string" and "anyOf" not in header["schema"]  # no null: a header has none
        assert "no-cache" in header["description"]
    body = at_limit("/score", pairs=1)
    forwarded = limited_server.metric("qtrel_batch_pairs_sum")
    for value, fresh in (("no-cache", 1), ("max-age=0, No-Cache", 1), ("max-age=60", 0), ("", 0)):
        r = httpx.post(limited_server.url + "/score", json=body, headers={"Cache-Control": value})
        assert r.status_code == 200, (value, r.text)
        assert limited_server.metric("qtrel_batch_pairs_sum") - forwarded == fresh, value
        forwarded += fresh
