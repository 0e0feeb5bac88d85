"""A one-logit head calibrated onto three levels (`qtrel calibrate --levels 1,2,3`), served: TEI /predict's
`raw_scores` answers the logit on the levels it sits on (the lowest at 0, the highest at z) and no level at
float32's lowest; the probabilities, /score's raw logit and the cut-point levels agree with the model."""

from __future__ import annotations

import csv
import math
import random

import httpx
import pytest
import torch

from model.relevance import RelevanceModel
from model.train.calibrate import calibrate
from tests.model.arch_fixtures import VOCAB, build_reference
from tests.service.conftest import live_server

pytest.importorskip("transformers")


def pairs(n: int) -> list[tuple[str, str]]:
    rng = random.Random(1)
    words = [f"w{i}" for i in range(VOCAB - 5)]
    return [(" ".join(rng.sample(words, 3)), " ".join(rng.sample(words, rng.randint(3, 20)))) for _ in range(n)]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """(checkpoint dir, its pairs, their logits z) of a one-logit XLM-R head graded 1..3 by fitted cut points."""
    tmp = tmp_path_factory.mktemp("logit3")
    build_reference("xlm-roberta", tmp / "src", 1, seed=5)
    data = pairs(120)
    model = RelevanceModel.load(tmp / "src")
    z = model.encoded_logits(model.encode(data), raw=True)[:, 0]
    truth = torch.bucketize(z, torch.quantile(z, torch.tensor([1 / 3, 2 / 3])), right=True) + 1
    with (tmp / "dev.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["query", "title", "level"])
        w.writerows([q, t, int(y)] for (q, t), y in zip(data, truth))
    calibrate(tmp / "src", tmp / "dev.csv", tmp / "out", levels=["1", "2", "3"])
    return tmp / "out", data[:8], z[:8]


def test_predict_raw_scores_of_a_calibrated_one_logit_head(calibrated):
    path, data, z = calibrated
    cal = RelevanceModel.load(path)
    want = cal.score(cal.encoded_logits(cal.encode(data)))
    assert set(want.level.tolist()) == {0, 1, 2}  # the middle level is graded too
    inputs = [list(p) for p in data]
    with live_server(path, max_wait_ms=5) as srv:
        raw = httpx.post(srv.url + "/predict", json={"inputs": inputs, "raw_scores": True}, timeout=30)
        assert raw.status_code == 200
        for got, zz in zip(raw.json(), z.tolist()):
            assert all(math.isfinite(p["score"]) and abs(p["score"]) < 1e6 for p in got)
            assert {p["label"]: p["score"] for p in got} == pytest.approx({"1": 0.0, "3": zz}, abs=1e-4)
            assert [p["score"] for p in got] == sorted((p["score"] for p in got), reverse=True)
        single = httpx.post(srv.url + "/predict", json={"inputs": inputs[0], "raw_scores": True}).json()
        assert single == raw.json()[0]
        probs = httpx.post(srv.url + "/predict", json={"inputs": inputs}, timeout=30).json()
        for got, p in zip(probs, want.probs.tolist()):
            assert {x["label"]: x["score"] for x in got} == pytest.approx(dict(zip(["1", "2", "3"], p)), abs=1e-5)
        body = {"query": data[0][0], "titles": [t for _, t in data]}  # one query: /score takes one per request
        score = httpx.post(srv.url + "/score", json={**body, "raw_scores": True}, timeout=30).json()["results"]
        assert all(math.isfinite(r["score"]) for r in score)
