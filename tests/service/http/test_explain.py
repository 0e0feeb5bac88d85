"""/explain and /explain/view on a live server: body shape, refusals, the per-app rate limit."""

from __future__ import annotations

import httpx
import pytest

from service.http.explain import RateLimiter
from tests.service.conftest import live_server

PAIR = {"query": "cordless drill", "title": "dewalt 20v max cordless drill kit"}


def test_explanation_body(server):
    r = httpx.post(server.url + "/explain", json=PAIR, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {
        "model",
        "labels",
        "level",
        "score",
        "probs",
        "truncated",
        "tokens",
        "layers",
        "term_matching_heads",
        "occlusion",
    }
    T = len(body["tokens"])
    assert [len(layer["heads"]) for layer in body["layers"]] == [4, 4]
    assert all(len(h["cls"]) == T for layer in body["layers"] for h in layer["heads"])
    assert len(body["occlusion"]["attribution"]) == T
    assert {(h["layer"], h["head"]) for h in body["term_matching_heads"]} and len(body["term_matching_heads"]) == 5
    # the same score as /score gives for the pair
    s = httpx.post(server.url + "/score", json={"query": PAIR["query"], "titles": [PAIR["title"]]}).json()
    assert body["score"] == pytest.approx(s["results"][0]["score"], abs=1e-4)
    assert body["level"] == s["results"][0]["level"]

    r = httpx.post(server.url + "/explain", json={**PAIR, "attention": True, "top_heads": 2}, timeout=30)
    assert r.status_code == 200, r.text
    att = r.json()["attention"]
    assert (len(att), len(att[0]), len(att[0][0]), len(att[0][0][0])) == (2, 4, T, T)
    assert len(r.json()["term_matching_heads"]) == 2


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({**PAIR, "extra": 1}, 422, "validation"),
        ({"query": "drill"}, 422, "validation"),
        ({**PAIR, "title": "   "}, 422, "validation"),
        ({**PAIR, "attention": "yes"}, 422, "validation"),
        ({**PAIR, "truncation": "middle"}, 422, "validation"),
        ({**PAIR, "query": 3}, 422, "validation"),
        ({**PAIR, "title": "x" * 2001}, 413, "payload_too_large"),
        (b"{not json", 400, "bad_request"),
    ],
)
def test_bad_bodies_are_refused(server, body, status, kind):
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(server.url + "/explain", **kw)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == kind


def test_view_is_a_self_contained_page(server):
    r = httpx.get(server.url + "/explain/view")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<form" in r.text and "attention: true" in r.text
    assert "http://" not in r.text.replace("http://www.w3.org/2000/svg", "") and "https://" not in r.text


def test_rate_limit(tiny_checkpoint):
    with live_server(tiny_checkpoint, explain_per_minute=2) as srv:
        codes = [httpx.post(srv.url + "/explain", json=PAIR, timeout=30) for _ in range(3)]
        assert [r.status_code for r in codes] == [200, 200, 429]
        r = codes[2]
        assert r.json()["error_type"] == "rate_limited" and "2 explanations a minute" in r.json()["error"]
        assert 1 <= int(r.headers["retry-after"]) <= 30  # a token comes back every 30 s
        assert httpx.post(srv.url + "/score", json={"query": "a", "titles": ["b"]}).status_code == 200  # unaffected
        assert srv.metric("qtrel_rejected_total", reason="rate_limited") == 1


def test_zero_per_minute_disables_explanations(tiny_checkpoint):
    with live_server(tiny_checkpoint, explain_per_minute=0) as srv:
        for r in (httpx.post(srv.url + "/explain", json=PAIR), httpx.get(srv.url + "/explain/view")):
            assert r.status_code == 404
            assert r.json()["error_type"] == "not_found" and "explain_per_minute=0" in r.json()["error"]


def test_token_bucket_refills_at_its_rate():
    now = [0.0]
    bucket = RateLimiter(6, clock=lambda: now[0])  # one token every 10 s, bursts of 6
    assert [bucket.take() for _ in range(6)] == [None] * 6
    assert bucket.take() == pytest.approx(10)
    now[0] = 4.0
    assert bucket.take() == pytest.approx(6)
    now[0] = 10.0
    assert bucket.take() is None and bucket.take() == pytest.approx(10)
    now[0] = 1000.0  # refills up to the burst size only
    assert [bucket.take() for _ in range(7)][-2:] == [None, pytest.approx(10)]
