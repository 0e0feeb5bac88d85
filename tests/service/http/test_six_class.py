"""A checkpoint with a "not a candidate" class served end to end: every route answers with its five levels,
the same as the model scores them in process."""

from __future__ import annotations

import httpx
import pytest

from model.relevance import RelevanceModel
from tests.conftest import make_tiny_checkpoint, read_pairs
from tests.service.conftest import live_server

SIX = {i: lab for i, lab in enumerate(["1", "2", "3", "4", "5", "1"])}


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("six") / "tiny-six", seed=5, id2label=SIX)


def test_score_rerank_predict_and_explain_grade_five_levels(six):
    pairs = read_pairs(6)
    query, titles = pairs[0][0], [t for _, t in pairs]
    m = RelevanceModel.load(six, onednn=False, unpadded=False)
    want = m.predict([(query, t) for t in titles])
    with live_server(six, max_wait_ms=5) as srv:
        info = httpx.get(srv.url + "/info").json()
        assert info["levels"] == ["1", "2", "3", "4", "5"]
        got = httpx.post(srv.url + "/score", json={"query": query, "titles": titles}, timeout=30).json()["results"]
        for r, w in zip(got, want):
            assert list(r["probs"]) == ["1", "2", "3", "4", "5"] and r["level"] == m.labels[w.level]
            assert r["score"] == pytest.approx(w.expected, abs=1e-4)
        rr = httpx.post(srv.url + "/v1/rerank", json={"query": query, "documents": titles}, timeout=30)
        assert rr.status_code == 200 and len(rr.json()["results"]) == len(titles)
        ex = httpx.post(srv.url + "/explain", json={"query": query, "title": titles[0]}, timeout=30)
        assert ex.status_code == 200, ex.text
        assert len(ex.json()["probs"]) == 5 and ex.json()["score"] == pytest.approx(want[0].expected, abs=1e-3)
