"""`min_level` and `min_score` on /score, TEI's /rerank and Cohere's /v1, /v2/rerank, on the live server: a result
below the cut-off is left out and counted, the rest answer exactly as without it."""

from __future__ import annotations

import httpx
import pytest

QUERY = "cordless drill"
TITLES = [
    "DEWALT 20V MAX Cordless Drill",
    "Garden hose 50 ft",
    "Cordless drill driver kit with battery",
    "Ceiling fan light kit",
    "Drill bits set 29 piece",
    "Organic bananas, 1 lb",
    "Milwaukee M18 hammer drill",
    "Paint roller 9 in.",
]
LEVELS = ["1", "2", "3", "4", "5"]  # the tiny checkpoint's


def graded(server) -> list[dict]:
    r = httpx.post(server.url + "/score", json={"query": QUERY, "titles": TITLES})
    assert r.status_code == 200, r.text
    assert "below_cutoff" not in r.json() and "x-below-cutoff" not in r.headers  # no cut-off: the answer as before
    return r.json()["results"]


def middle_level(results: list[dict]) -> str:
    """A level that keeps some results and leaves some out, when the checkpoint grades them apart."""
    levels = sorted({x["level"] for x in results}, key=LEVELS.index)
    if len(levels) < 2:
        pytest.skip("the tiny checkpoint gave every title one level")
    return levels[len(levels) // 2]


def test_min_level_on_score_keeps_exactly_the_results_at_or_above_it(server):
    every = graded(server)
    floor = middle_level(every)
    want = [x for x in every if LEVELS.index(x["level"]) >= LEVELS.index(floor)]
    for given in (floor, int(floor)):  # a level by its label, or the whole number it spells
        r = httpx.post(server.url + "/score", json={"query": QUERY, "titles": TITLES, "min_level": given})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["results"] == want
        assert body["below_cutoff"] == len(TITLES) - len(want) > 0
        assert r.headers["x-below-cutoff"] == str(body["below_cutoff"])


def test_min_score_on_score_and_top_n_after_it(server):
    every = graded(server)
    scores = sorted(x["score"] for x in every)
    cut = scores[len(scores) // 2]  # half of them at or above it
    want = [x for x in every if x["score"] >= cut]
    body = httpx.post(server.url + "/score", json={"query": QUERY, "titles": TITLES, "min_score": cut}).json()
    assert body["results"] == want and body["below_cutoff"] == len(TITLES) - len(want)
    top = httpx.post(
        server.url + "/score", json={"query": QUERY, "titles": TITLES, "min_score": cut, "top_n": 1}
    ).json()
    assert top["results"] == [max(want, key=lambda x: x["score"])]
    assert top["below_cutoff"] == body["below_cutoff"]  # top_n's cut is not counted as below the cut-off
    nothing = httpx.post(server.url + "/score", json={"query": QUERY, "titles": TITLES, "min_score": 99}).json()
    assert nothing["results"] == [] and nothing["below_cutoff"] == len(TITLES)


def test_both_cut_offs_must_hold(server):
    every = graded(server)
    floor = middle_level(every)
    cut = sorted(x["score"] for x in every)[len(every) // 2]
    want = [x for x in every if LEVELS.index(x["level"]) >= LEVELS.index(floor) and x["score"] >= cut]
    body = httpx.post(
        server.url + "/score", json={"query": QUERY, "titles": TITLES, "min_level": floor, "min_score": cut}
    ).json()
    assert body["results"] == want and body["below_cutoff"] == len(TITLES) - len(want)


def test_tei_rerank_counts_what_it_left_out_in_a_header(server):
    every = graded(server)
    floor = middle_level(every)
    r = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": TITLES, "min_level": floor})
    assert r.status_code == 200, r.text
    kept = {x["index"] for x in every if LEVELS.index(x["level"]) >= LEVELS.index(floor)}
    assert {x["index"] for x in r.json()} == kept
    assert r.headers["x-below-cutoff"] == str(len(TITLES) - len(kept))
    cut = sorted(x["score"] for x in every)[len(every) // 2]
    ranks = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": TITLES, "min_score": cut}).json()
    assert ranks and all(x["score"] >= cut for x in ranks)
    assert {x["index"] for x in ranks} == {x["index"] for x in every if x["score"] >= cut}


@pytest.mark.parametrize("path", ["/v1/rerank", "/v2/rerank"])
def test_cohere_min_score_is_on_relevance_score_and_min_level_on_the_level(server, path):
    every = graded(server)
    rel = {x["index"]: (x["score"] - 1) / 4 for x in every}  # relevance_score of levels 1..5
    cut = sorted(rel.values())[len(rel) // 2]
    body = httpx.post(server.url + path, json={"query": QUERY, "documents": TITLES, "min_score": cut}).json()
    assert {x["index"] for x in body["results"]} == {i for i, v in rel.items() if v >= cut}
    assert body["below_cutoff"] == sum(v < cut for v in rel.values())
    floor = middle_level(every)
    r = httpx.post(server.url + path, json={"query": QUERY, "documents": TITLES, "min_level": floor, "top_n": 1})
    kept = [x for x in every if LEVELS.index(x["level"]) >= LEVELS.index(floor)]
    assert [x["index"] for x in r.json()["results"]] == [max(kept, key=lambda x: x["score"])["index"]]
    assert r.json()["below_cutoff"] == len(TITLES) - len(kept)
    assert r.headers["x-below-cutoff"] == str(len(TITLES) - len(kept))


@pytest.mark.parametrize(
    "path, body, status, fragment",
    [
        ("/score", {"query": QUERY, "titles": TITLES, "min_level": "7"}, 422, "not a level of tiny-bert"),
        ("/score", {"query": QUERY, "titles": TITLES, "min_level": "high"}, 422, "its levels are 1, 2, 3, 4, 5"),
        ("/score", {"query": QUERY, "titles": TITLES, "min_level": True}, 422, "min_level"),
        ("/score", {"query": QUERY, "titles": TITLES, "min_score": "3"}, 422, "min_score"),
        ("/rerank", {"query": QUERY, "texts": TITLES, "min_level": 0}, 422, "not a level"),
        ("/v1/rerank", {"query": QUERY, "documents": TITLES, "min_score": 3.5}, 422, "min_score"),
        ("/v2/rerank", {"query": QUERY, "documents": TITLES, "min_level": 9}, 422, "not a level"),
    ],
)
def test_bad_cut_offs_are_422_in_the_error_shape(server, path, body, status, fragment):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == "validation" and fragment in r.json()["error"]
