"""Cohere-style documents as objects on /v1 and /v2/rerank: `rank_fields` choose the title, `id` and metadata
come back untouched, bad shapes are a 422 naming the document and field."""

from __future__ import annotations

import httpx
import pytest

QUERY = "cordless drill"
PRODUCTS = [
    {"id": "sku-1", "title": "DEWALT 20V MAX Cordless Drill", "brand": "DEWALT", "price": 99.0, "tags": ["tools"]},
    {"id": 2, "title": "Garden hose 50 ft", "brand": "Flexzilla", "stock": None},
    {"id": {"shop": "b", "n": 3}, "title": "Drill bits set 29 piece", "brand": ""},
]


def scores_of(server, titles: list[str]) -> list[float]:
    r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": titles})
    assert r.status_code == 200, r.text
    return [x["relevance_score"] for x in sorted(r.json()["results"], key=lambda x: x["index"])]


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_one_rank_field_scores_as_the_bare_string_and_echoes_the_object(server, path):
    want = scores_of(server, [p["title"] for p in PRODUCTS])
    r = httpx.post(
        server.url + path,
        json={"query": QUERY, "documents": PRODUCTS, "rank_fields": ["title"], "return_documents": True},
    )
    assert r.status_code == 200, r.text
    for x in r.json()["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-6)
        assert x["id"] == PRODUCTS[x["index"]]["id"]  # any JSON value, as sent
        assert x["document"] == PRODUCTS[x["index"]]  # the object untouched, every field


def test_several_rank_fields_form_named_lines_in_order_skipping_empty_ones(server):
    docs = [{**p, "brand": p["brand"]} for p in PRODUCTS]
    formed = [f"title: {p['title']}\nbrand: {p['brand']}" if p["brand"] else f"title: {p['title']}" for p in docs]
    want = scores_of(server, formed)
    r = httpx.post(
        server.url + "/v1/rerank", json={"query": QUERY, "documents": docs, "rank_fields": ["title", "brand"]}
    )
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert got == pytest.approx(dict(enumerate(want)), abs=1e-6)
    swapped = [f"brand: {p['brand']}\ntitle: {p['title']}" for p in docs[:2]]
    r2 = httpx.post(
        server.url + "/v1/rerank", json={"query": QUERY, "documents": docs[:2], "rank_fields": ["brand", "title"]}
    )
    got2 = {x["index"]: x["relevance_score"] for x in r2.json()["results"]}
    assert got2 == pytest.approx(dict(enumerate(scores_of(server, swapped))), abs=1e-6)


def test_text_objects_strings_and_ids_mix_and_ids_come_back_without_return_documents(server):
    docs = ["DEWALT 20V MAX Cordless Drill", {"text": "Garden hose 50 ft", "id": "h"}, {"text": "Drill bits set"}]
    r = httpx.post(server.url + "/v2/rerank", json={"query": QUERY, "documents": docs})
    assert r.status_code == 200, r.text
    by_index = {x["index"]: x for x in r.json()["results"]}
    assert by_index[1]["id"] == "h" and "id" not in by_index[0] and "id" not in by_index[2]
    assert all("document" not in x for x in by_index.values())  # return_documents is false by default
    echoed = httpx.post(server.url + "/v2/rerank", json={"query": QUERY, "documents": docs, "return_documents": True})
    for x in echoed.json()["results"]:
        d = docs[x["index"]]
        assert x["document"] == ({"text": d} if isinstance(d, str) else d)


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"documents": [{"title": "no text"}]}, "document 0 has no `text` field (or give rank_fields"),
        ({"documents": [{"text": 5}]}, "document 0: field `text` must be a string, not a number"),
        ({"documents": PRODUCTS, "rank_fields": ["title", "colour"]}, "document 0 has no `colour` field"),
        ({"documents": [PRODUCTS[1]], "rank_fields": ["title", "tags"]}, "document 0 has no `tags`"),
        ({"documents": [PRODUCTS[0]], "rank_fields": ["price"]}, "field `price` must be a string, not a number"),
        ({"documents": [PRODUCTS[0]], "rank_fields": ["tags"]}, "field `tags` must be a string, not an array"),
        ({"documents": [PRODUCTS[1]], "rank_fields": ["stock"]}, "field `stock` must be a string, not null"),
        ({"documents": [PRODUCTS[2]], "rank_fields": ["brand"]}, "document 0 is empty or whitespace"),
        ({"documents": ["x"], "rank_fields": []}, "rank_fields"),
        ({"documents": ["x"], "rank_fields": "title"}, "rank_fields"),
        ({"documents": ["x"], "rank_fields": [""]}, "rank_fields"),
        ({"documents": [["a list"]]}, "documents"),
    ],
)
def test_bad_documents_are_a_422_naming_the_document_and_field(server, body, fragment):
    r = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, **body})
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["error_type"] == "validation" and fragment in err["error"], err


def test_formed_titles_keep_the_text_limit(server):
    long = "x" * server.settings.max_text_chars
    r = httpx.post(
        server.url + "/v1/rerank",
        json={"query": QUERY, "documents": [{"title": long, "brand": "B"}], "rank_fields": ["title", "brand"]},
    )
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_cohere_sdk_v1_sends_objects_with_rank_fields(server):
    cohere = pytest.importorskip("cohere", reason="the cohere SDK is not installed (pip install cohere)")
    client = cohere.Client(api_key="x", base_url=server.url)
    resp = client.rerank(
        model="rerank-english-v3.0",
        query=QUERY,
        documents=PRODUCTS[:2],
        rank_fields=["title", "brand"],
        return_documents=True,
    )
    assert sorted(x.index for x in resp.results) == [0, 1]
