"""The level rule of a checkpoint is applied by the service exactly as by the model: /score, /explain
and /info agree with `RelevanceModel.predict` and `qtrel eval`."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
import torch

from model.checkpoint import load_module, save_checkpoint
from model.relevance import RelevanceModel
from model.scoring import LevelRule
from model.tokenizer import PairTokenizer
from tests.conftest import read_pairs
from tests.service.conftest import live_server


@pytest.fixture(scope="module")
def pairs():
    return read_pairs(24)  # a fixture, not a module constant: without the data the tests skip, not the collection


@pytest.fixture(scope="module")
def cut_checkpoint(tiny_checkpoint, tmp_path_factory, pairs):
    """The tiny model with cut points at the quartiles of its own scores on `pairs`."""
    scores = torch.tensor([p.expected for p in RelevanceModel.load(tiny_checkpoint).predict(pairs)])
    q = torch.quantile(scores, torch.tensor([0.2, 0.4, 0.6, 0.8])).tolist()
    module = load_module(tiny_checkpoint)
    module.cfg = replace(module.cfg, extra={**module.cfg.extra, **LevelRule(tuple(q)).to_extra()})
    out = tmp_path_factory.mktemp("cut") / "tiny-cut"
    save_checkpoint(module, PairTokenizer.from_dir(tiny_checkpoint), out)
    return out


def test_score_explain_and_info_follow_the_checkpoints_rule(cut_checkpoint, pairs):
    m = RelevanceModel.load(cut_checkpoint, onednn=False, unpadded=False)
    want = m.predict(pairs)
    assert len({p.level for p in want}) >= 4  # the rule, not argmax, decides (argmax of this model is one level)
    with live_server(cut_checkpoint, max_wait_ms=5) as srv:
        r = httpx.post(srv.url + "/score", json={"pairs": [{"query": q, "title": t} for q, t in pairs]}, timeout=30)
        assert r.status_code == 200
        got = r.json()["results"]
        assert [g["level"] for g in got] == [m.labels[p.level] for p in want]
        assert [g["score"] for g in got] == pytest.approx([p.expected for p in want], abs=1e-4)
        q, t = pairs[3]
        e = httpx.post(srv.url + "/explain", json={"query": q, "title": t}, timeout=60).json()
        assert e["level"] == m.labels[want[3].level] and e["score"] == pytest.approx(want[3].expected, abs=1e-4)
        info = httpx.get(srv.url + "/info").json()
        assert info["model"]["level_rule"] == "expected-level cut points"
        assert info["model"]["level_cuts"] == pytest.approx(list(RelevanceModel.load(cut_checkpoint).rule.cuts))
