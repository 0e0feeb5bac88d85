"""Long documents in windows on a live server (tiny checkpoint): `max_chunks` on /score and /rerank,
Cohere's `max_chunks_per_doc` on /v1 and /v2/rerank. Each window is an ordinary pair: scored by hand it is
the same cache entry (the same bytes, no forward), and the document gets its best window's scores."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from model.tokenizer import SPECIAL_TOKENS_IN_PAIR, PairTokenizer
from model.windows import split
from tests.service.conftest import live_server, run

QUERY = "cordless drill"
LONG = (
    "DEWALT 20V MAX XR Lithium-Ion Brushless Cordless 1/2 in. Drill/Driver Kit with two 5.0Ah batteries, a "
    "charger and a contractor bag. Garden hose 50 ft with a brass nozzle, ceiling fan light kit, organic "
    "bananas and a set of drill bits, 29 pieces, in a carry case; ünïcödé café crème and 日本語のテキスト. "
) * 3  # ~300 pieces: several windows of the tiny model's 128


def by_hand(tiny_checkpoint, title: str, overlap: int, limit: int):
    tok = PairTokenizer.from_dir(tiny_checkpoint)
    size = tok.max_length - SPECIAL_TOKENS_IN_PAIR - len(tok.encode_texts([QUERY])[0])
    ((offsets, words),) = tok.word_offsets([title])
    return split(title, offsets, words, size, overlap, limit)


def post(srv, path, body, **kw):
    r = httpx.post(srv.url + path, json=body, timeout=60, **kw)
    assert r.status_code == 200, (path, r.text)
    return r.json()


@pytest.fixture(scope="module")
def srv(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=5, cache_mb=8) as s:
        yield s


def test_a_document_gets_its_best_windows_scores_the_same_as_that_window_scored_by_hand(srv, tiny_checkpoint):
    windows = by_hand(tiny_checkpoint, LONG, 16, 10)
    assert len(windows) >= 3 and windows[-1].end == len(LONG.rstrip())
    forwards = srv.metric("qtrel_batch_pairs_sum")
    got = post(srv, "/score", {"query": QUERY, "titles": [LONG], "max_chunks": 10, "chunk_overlap": 16})
    (r,) = got["results"]
    assert srv.metric("qtrel_batch_pairs_sum") - forwards == len(windows)  # each window forwarded once
    w = r["window"]
    assert w["count"] == len(windows) and LONG[w["start"] : w["end"]] == windows[w["index"]].text
    # every window by hand, as ordinary titles: all cache hits of the same pairs, no forward
    hand = post(srv, "/score", {"query": QUERY, "titles": [x.text for x in windows]})["results"]
    assert srv.metric("qtrel_batch_pairs_sum") - forwards == len(windows)
    k = max(range(len(hand)), key=lambda i: (hand[i]["score"], -i))
    assert w["index"] == k
    assert {f: r[f] for f in ("level", "score", "probs", "tokens", "truncated")} == {
        f: hand[k][f] for f in ("level", "score", "probs", "tokens", "truncated")
    }  # bit-identical: JSON floats compared exactly
    # and past the cache: the windows scored afresh pick the same window with the same numbers
    fresh = post(
        srv, "/score", {"query": QUERY, "titles": [x.text for x in windows]}, headers={"Cache-Control": "no-cache"}
    )
    assert [x["score"] for x in fresh["results"]] == pytest.approx([x["score"] for x in hand], abs=1e-5)
    # without windows the same document is truncated: another pair
    plain = post(srv, "/score", {"query": QUERY, "titles": [LONG]})["results"][0]
    assert plain["truncated"] and "window" not in plain and not r["truncated"]


def test_short_documents_are_left_as_they_are(srv):
    titles = ["DEWALT 20V MAX Cordless Drill", "Garden hose 50 ft"]
    plain = post(srv, "/score", {"query": QUERY, "titles": titles})["results"]
    windowed = post(srv, "/score", {"query": QUERY, "titles": titles, "max_chunks": 4})["results"]
    for p, w, t in zip(plain, windowed, titles):
        assert w.pop("window") == {"index": 0, "count": 1, "start": 0, "end": len(t)}
        assert w == p


def test_max_chunks_limits_the_windows_and_overlap_defaults_to_the_setting(srv, tiny_checkpoint):
    r = post(srv, "/score", {"query": QUERY, "titles": [LONG, "Garden hose"], "max_chunks": 2})["results"]
    assert r[0]["window"]["count"] == 2 and r[1]["window"]["count"] == 1
    default = by_hand(tiny_checkpoint, LONG, 32, 2)  # chunk_overlap's default
    assert LONG[r[0]["window"]["start"] : r[0]["window"]["end"]] == default[r[0]["window"]["index"]].text


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_cohere_max_chunks_per_doc(srv, path, tiny_checkpoint):
    docs = [LONG, "Garden hose 50 ft", {"text": "Drill bits set"}]
    scored = post(srv, "/score", {"query": QUERY, "titles": [LONG, docs[1], "Drill bits set"], "max_chunks": 5})
    got = post(srv, path, {"model": "m", "query": QUERY, "documents": docs, "max_chunks_per_doc": 5})
    for x in got["results"]:
        want = scored["results"][x["index"]]
        assert x["window"] == want["window"]
        assert x["relevance_score"] == pytest.approx((want["score"] - 1) / 4, abs=1e-12)
    query = len(PairTokenizer.from_dir(tiny_checkpoint).encode_texts([QUERY])[0])
    windows = sum(w.tokens + query + SPECIAL_TOKENS_IN_PAIR for w in by_hand(tiny_checkpoint, LONG, 32, 5))
    short = sum(r["tokens"] for r in scored["results"][1:])
    assert got["meta"]["billed_units"]["input_tokens"] == windows + short  # every window is billed, not the best
    assert got["usage"]["total_tokens"] == got["meta"]["tokens"]["input_tokens"]
    plain = post(srv, path, {"query": QUERY, "documents": docs})
    assert all("window" not in x for x in plain["results"])  # off unless asked for


def test_tei_rerank_takes_max_chunks(srv):
    got = post(srv, "/rerank", {"query": QUERY, "texts": [LONG, "Garden hose"], "max_chunks": 3, "truncate": False})
    assert {x["index"]: x["window"]["count"] for x in got} == {0: 3, 1: 1}
    # without windows, TEI's truncate=false refuses the long text
    r = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": [LONG], "truncate": False})
    assert r.status_code == 413


@pytest.mark.parametrize(
    "path,body",
    [
        ("/score", {"max_chunks": 0}),
        ("/score", {"max_chunks": -2}),
        ("/score", {"max_chunks": "3"}),
        ("/score", {"max_chunks": 2.5}),
        ("/score", {"max_chunks": 2, "chunk_overlap": -1}),
        ("/score", {"max_chunks": 2, "chunk_overlap": 513}),
        ("/score", {"chunk_overlap": 8}),
        ("/rerank", {"max_chunks": 0}),
        ("/rerank", {"chunk_overlap": 8}),
        ("/v1/rerank", {"max_chunks_per_doc": 0}),
        ("/v2/rerank", {"max_chunks_per_doc": True}),
        ("/v2/rerank", {"chunk_overlap": 4}),
    ],
)
def test_bad_window_options_are_422(srv, path, body):
    texts = {"/score": {"query": QUERY, "titles": [LONG]}, "/rerank": {"query": QUERY, "texts": [LONG]}}
    base = texts.get(path, {"query": QUERY, "documents": [LONG]})
    r = httpx.post(srv.url + path, json=base | body)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "validation" and set(r.json()) == {"error", "error_type"}


def test_windows_count_against_the_pairs_per_request(tiny_checkpoint):
    with live_server(tiny_checkpoint, replicas=1, max_pairs_per_request=8, cache_mb=0) as s:
        ok = httpx.post(s.url + "/score", json={"query": QUERY, "titles": [LONG, LONG], "max_chunks": 4})
        assert ok.status_code == 200, ok.text
        r = httpx.post(s.url + "/score", json={"query": QUERY, "titles": [LONG, LONG, LONG], "max_chunks": 4})
        assert r.status_code == 413 and r.json()["error_type"] == "payload_too_large"
        assert "9 windows; at most 8 pairs" in r.json()["error"]  # LONG makes 3 windows
        assert s.metric("qtrel_batch_pairs_sum") == 3  # the same windows twice: forwarded once; the refused: none


def test_windows_are_admitted_like_pairs_a_full_queue_is_429(tiny_checkpoint):
    # A batch waits up to 1.5 s to fill: 4 admitted pairs hold 4 of the 6 places; LONG's 3 windows do not fit.
    with live_server(
        tiny_checkpoint, max_queue_pairs=6, max_pairs_per_request=6, max_wait_ms=1500, max_batch_size=64, cache_mb=0
    ) as s:

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                held = asyncio.create_task(
                    client.post(s.url + "/score", json={"query": "q", "titles": ["t1", "t2", "t3", "t4"]})
                )
                await asyncio.sleep(0.5)
                body = {"query": QUERY, "documents": [LONG], "max_chunks_per_doc": 4}
                refused = await client.post(s.url + "/v2/rerank", json=body)
                return await held, refused

        held, refused = run(main())
        assert held.status_code == 200
        assert refused.status_code == 429 and refused.json()["error_type"] == "overloaded", refused.text
        assert int(refused.headers["retry-after"]) >= 1
        again = httpx.post(s.url + "/v2/rerank", json={"query": QUERY, "documents": [LONG], "max_chunks_per_doc": 4})
        assert again.status_code == 200 and again.json()["results"][0]["window"]["count"] == 3
