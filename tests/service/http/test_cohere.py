"""/v1/rerank and /v2/rerank in Cohere's shape, on the live server, by hand and through Cohere's own SDK."""

from __future__ import annotations

import httpx
import pytest

TITLES = [
    "DEWALT 20V MAX Cordless Drill",
    "Garden hose 50 ft",
    "Cordless drill driver kit with battery",
    "Ceiling fan light kit",
    "Drill bits set 29 piece",
]
QUERY = "cordless drill"


def expected_levels(server, titles=TITLES):
    r = httpx.post(server.url + "/score", json={"query": QUERY, "titles": titles, "return_probs": False})
    assert r.status_code == 200, r.text
    return [x["score"] for x in r.json()["results"]]


def relevance_of(e: float) -> float:
    return (e - 1) / 4  # the tiny checkpoint's levels are 1..5


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_rerank_sorted_with_scores_from_the_expected_level(server, path):
    want = expected_levels(server)
    r = httpx.post(server.url + path, json={"model": "rerank-v3.5", "query": QUERY, "documents": TITLES})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] and body["model"] == "tiny-bert"
    res = body["results"]
    assert sorted(x["index"] for x in res) == list(range(len(TITLES)))
    scores = [x["relevance_score"] for x in res]
    assert scores == sorted(scores, reverse=True)
    for x in res:
        assert 0.0 <= x["relevance_score"] <= 1.0
        assert x["relevance_score"] == pytest.approx(relevance_of(want[x["index"]]), abs=1e-6)
        assert "document" not in x  # return_documents defaults to false
    assert body["meta"]["api_version"]["version"] == path[2]
    assert body["meta"]["billed_units"]["search_units"] == 1
    assert body["usage"]["total_tokens"] == body["meta"]["tokens"]["input_tokens"] > 0


def test_documents_as_objects_top_n_and_return_documents(server):
    docs = [{"text": t, "id": f"doc-{i}"} for i, t in enumerate(TITLES)]
    r = httpx.post(
        server.url + "/v1/rerank", json={"query": QUERY, "documents": docs, "top_n": 2, "return_documents": True}
    )
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == 2
    for x in res:
        assert x["document"] == docs[x["index"]]  # the object as sent, its id included
        assert x["id"] == f"doc-{x['index']}"
    every = httpx.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": TITLES}).json()["results"]
    assert [x["index"] for x in res] == [x["index"] for x in every[:2]]
    mixed = httpx.post(
        server.url + "/v2/rerank", json={"query": QUERY, "documents": [TITLES[0], {"text": TITLES[1]}], "top_n": 10}
    )
    assert mixed.status_code == 200 and len(mixed.json()["results"]) == 2


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"query": QUERY, "documents": []}, 422, "documents"),
        ({"query": QUERY}, 422, "documents"),
        ({"query": " ", "documents": ["x"]}, 422, "query is empty"),
        ({"query": QUERY, "documents": ["ok", "  "]}, 422, "document 1 is empty"),
        ({"query": QUERY, "documents": [{"title": "no text"}]}, 422, "text"),
        ({"query": QUERY, "documents": [3]}, 422, "documents"),
        ({"query": QUERY, "documents": ["x"], "top_n": 0}, 422, "top_n"),
        ({"query": QUERY, "documents": ["x"], "return_documents": "yes"}, 422, "return_documents"),
    ],
)
def test_invalid_requests_get_the_one_error_shape(server, body, status, fragment):
    r = httpx.post(server.url + "/v1/rerank", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"error", "error_type"} and err["error_type"] == "validation"
    assert fragment in err["error"]


def test_request_limits_apply(server):
    n = server.settings.max_pairs_per_request + 1
    r = httpx.post(server.url + "/v2/rerank", json={"query": QUERY, "documents": ["x"] * n})
    assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"


def test_openapi_says_what_relevance_score_is(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/rerank", "/v2/rerank"):
        assert "(E - 1) / (k - 1)" in spec["paths"][path]["post"]["description"]
    result = spec["components"]["schemas"]["CompatRerankResult"]["properties"]["relevance_score"]
    assert "expected level" in result["description"]


# --- a real client: Cohere's Python SDK pointed at the live server ------------------------------------
def test_cohere_sdk_v2_client(server):
    cohere = pytest.importorskip("cohere", reason="the cohere SDK is not installed (pip install cohere)")
    want = expected_levels(server)
    client = cohere.ClientV2(api_key="x", base_url=server.url)
    resp = client.rerank(model="rerank-v3.5", query=QUERY, documents=TITLES, top_n=3)
    assert len(resp.results) == 3
    scores = [x.relevance_score for x in resp.results]
    assert scores == sorted(scores, reverse=True)
    for x in resp.results:
        assert x.relevance_score == pytest.approx(relevance_of(want[x.index]), abs=1e-6)
    assert resp.meta.api_version.version == "2" and resp.meta.billed_units.search_units == 1


def test_cohere_sdk_v1_client_with_documents(server):
    cohere = pytest.importorskip("cohere", reason="the cohere SDK is not installed (pip install cohere)")
    client = cohere.Client(api_key="x", base_url=server.url)
    resp = client.rerank(model="rerank-english-v3.0", query=QUERY, documents=TITLES, return_documents=True)
    assert sorted(x.index for x in resp.results) == list(range(len(TITLES)))
    for x in resp.results:
        assert x.document.text == TITLES[x.index]


def test_cohere_sdk_sees_the_error(server):
    cohere = pytest.importorskip("cohere", reason="the cohere SDK is not installed (pip install cohere)")
    from cohere.core.api_error import ApiError

    client = cohere.ClientV2(api_key="x", base_url=server.url)
    with pytest.raises(ApiError) as e:
        client.rerank(model="rerank-v3.5", query=QUERY, documents=["fine", " "])
    assert e.value.status_code == 422
    assert e.value.body["error_type"] == "validation"


# --- behind API keys: /v1/rerank, /v2/rerank and /tokenize are in app.PROTECTED_ROUTERS ----------------
def test_compat_routes_need_the_key_and_the_cohere_sdk_sends_it(tiny_checkpoint):
    from tests.service.conftest import live_server

    key = "compat-key-0123456789"
    with live_server(tiny_checkpoint, max_wait_ms=5, api_keys=key, replicas=1) as srv:
        for path, body in (
            ("/v1/rerank", {"query": QUERY, "documents": TITLES}),
            ("/v2/rerank", {"query": QUERY, "documents": TITLES}),
            ("/tokenize", {"query": QUERY, "title": TITLES[0]}),
        ):
            r = httpx.post(srv.url + path, json=body)
            assert r.status_code == 401 and r.json()["error_type"] == "unauthorized", path
            ok = httpx.post(srv.url + path, json=body, headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, (path, ok.text)
        try:
            import cohere
            from cohere.core.api_error import ApiError
        except ImportError:
            return  # the hand-written requests above still ran
        with pytest.raises(ApiError) as e:
            cohere.ClientV2(api_key="wrong", base_url=srv.url).rerank(model="m", query=QUERY, documents=TITLES)
        assert e.value.status_code == 401
        resp = cohere.ClientV2(api_key=key, base_url=srv.url).rerank(model="m", query=QUERY, documents=TITLES)
        assert len(resp.results) == len(TITLES)
