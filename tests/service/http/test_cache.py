"""The pair-score cache on a live server: every scoring route shares it, a hit answers what the forward
answered, `Cache-Control: no-cache` scores afresh, and a pair asked for by concurrent requests on different
routes is forwarded once (counted from the server's own qtrel_batch_pairs)."""

from __future__ import annotations

import asyncio

import httpx

from tests.conftest import read_pairs
from tests.service.conftest import live_server, run


def forwarded(srv) -> float:
    return srv.metric("qtrel_batch_pairs_sum")


def test_a_hit_answers_what_the_forward_did_and_no_cache_goes_past_it(tiny_checkpoint):
    pairs = read_pairs(10)
    body = {"pairs": [{"query": q, "title": t} for q, t in pairs]}
    distinct = len(set(pairs))
    with live_server(tiny_checkpoint, cache_mb=4) as srv:
        miss = httpx.post(srv.url + "/score", json=body)
        assert miss.status_code == 200 and forwarded(srv) == distinct
        hit = httpx.post(srv.url + "/score", json=body)
        assert hit.content == miss.content  # the same bytes: probabilities, score, level, tokens, truncated
        assert forwarded(srv) == distinct and srv.metric("qtrel_cache_hits_total") == distinct
        fresh = httpx.post(srv.url + "/score", json=body, headers={"Cache-Control": "max-age=0, No-Cache"})
        assert fresh.content == miss.content and forwarded(srv) == 2 * distinct
        assert srv.metric("qtrel_cache_hits_total") == distinct  # not looked up

        # the other routes share the cache: no forward for pairs /score scored
        q, t = pairs[0]
        for path, payload in (
            ("/predict", {"inputs": [q, t]}),
            ("/rerank", {"query": q, "texts": [t]}),
            ("/v1/rerank", {"query": q, "documents": [t]}),
            ("/v2/rerank", {"query": q, "documents": [{"text": t}]}),
        ):
            assert httpx.post(srv.url + path, json=payload).status_code == 200, path
        assert forwarded(srv) == 2 * distinct
        probs = httpx.post(srv.url + "/predict", json={"inputs": [q, t]}).json()
        assert {p["label"]: p["score"] for p in probs} == miss.json()["results"][0]["probs"]

        cache = httpx.get(srv.url + "/info").json()["cache"]
        assert cache["enabled"] and cache["max_bytes"] == 4 * 2**20 and cache["entries"] == distinct
        assert cache["generation"] == 1 and cache["bytes"] == srv.metric("qtrel_cache_bytes") > 0
        assert httpx.get(srv.url + "/info").json()["settings"]["cache_mb"] == 4


def test_concurrent_requests_on_every_route_forward_a_pair_once(tiny_checkpoint):
    q, t = "cordless drill", "DEWALT 20V MAX cordless drill kit"
    calls = [
        ("/score", {"query": q, "titles": [t, t, "garden hose"]}),
        ("/predict", {"inputs": [[q, t], [q, "garden hose"]]}),
        ("/rerank", {"query": q, "texts": [t]}),
        ("/v1/rerank", {"query": q, "documents": [t, t]}),
        ("/v2/rerank", {"query": q, "documents": ["garden hose", t]}),
    ]
    with live_server(tiny_checkpoint, cache_mb=0, max_wait_ms=300) as srv:  # cache off: single flight alone

        async def main():
            async with httpx.AsyncClient(timeout=30) as client:
                return await asyncio.gather(*(client.post(srv.url + path, json=b) for path, b in calls))

        rs = run(main())
        assert [r.status_code for r in rs] == [200] * len(calls)
        assert forwarded(srv) == 2  # two distinct pairs among ten
        folded = srv.metric("qtrel_duplicates_folded_total")
        assert folded == 10 - 2 and srv.metric("qtrel_duplicates_folded_total", where="request") == 2
        scores = rs[0].json()["results"]
        assert scores[0]["probs"] == scores[1]["probs"]
        assert httpx.get(srv.url + "/info").json()["cache"]["enabled"] is False
        assert srv.metric("qtrel_cache_hits_total") == srv.metric("qtrel_cache_misses_total") == 0
