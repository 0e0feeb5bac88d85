"""A model with exact-match segment ids (model.tokenizer.MATCH_OFFSET) served end to end: /tokenize shows the
marks, /score equals the model's own predictions (the model processes encode the marks too), /explain names them."""

from __future__ import annotations

import httpx
import pytest
import torch

from model.checkpoint import load_module, save_checkpoint
from model.relevance import RelevanceModel
from model.tokenizer import PairTokenizer
from model.train.loop import add_match_segments
from tests.service.conftest import live_server

QUERY = "cordless drill"
TITLES = ["DEWALT 20V MAX Cordless Drill", "Moby Dick by Herman Melville", "drill bit set"]


@pytest.fixture(scope="module")
def marking(tiny_checkpoint, tmp_path_factory):
    module, tok = load_module(tiny_checkpoint), PairTokenizer.from_dir(tiny_checkpoint)
    add_match_segments(module, tok)
    with torch.no_grad():
        w = module.bert.embeddings.token_type.weight
        w[2:] += torch.randn(w[2:].shape, generator=torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("marking") / "tiny-marking"
    save_checkpoint(module, tok, path)
    return path


def test_a_marking_model_served_end_to_end(marking, tiny_checkpoint):
    want = RelevanceModel.load(marking).predict([(QUERY, t) for t in TITLES])
    plain = RelevanceModel.load(tiny_checkpoint).predict([(QUERY, t) for t in TITLES])
    assert [round(w.score, 3) for w in want] != [round(p.score, 3) for p in plain]  # the marks matter
    with live_server(marking, max_wait_ms=2) as srv:
        r = httpx.post(srv.url + "/tokenize", json={"query": QUERY, "title": TITLES[0]})
        assert r.status_code == 200, r.text
        (res,) = r.json()["results"]
        marked = {t["text"]: (t["segment"], t["match"]) for t in res["tokens"] if not t["special"]}
        assert marked["drill"] == (1, True) and marked["max"] == (1, False)
        assert max(res["token_type_ids"]) == 3 and [t["segment"] for t in res["tokens"]] == [
            g % 2 for g in res["token_type_ids"]
        ]
        r = httpx.post(srv.url + "/score", json={"query": QUERY, "titles": TITLES})
        assert r.status_code == 200, r.text
        got = r.json()["results"]
        assert [g["score"] for g in got] == pytest.approx([w.score for w in want], abs=1e-4)
        r = httpx.post(srv.url + "/explain", json={"query": QUERY, "title": TITLES[2]})
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        assert [(t["token"], t["match"]) for t in tokens if t["segment"] == 1 and not t["special"]] == [
            ("drill", True),
            ("bit", False),
            ("set", False),
        ]
