"""`qtrel calibrate` on a one-logit head: its levels and their cut points, fitted on labelled pairs, graded
wherever the checkpoint is loaded, with its sigmoid kept as the 0..1 score."""

from __future__ import annotations

import csv
import random

import pytest
import torch

from model.relevance import RelevanceModel
from model.train.calibrate import calibrate
from tests.model.arch_fixtures import VOCAB, build_reference

pytest.importorskip("transformers")


def pairs(n: int) -> list[tuple[str, str]]:
    rng = random.Random(0)
    words = [f"w{i}" for i in range(VOCAB - 5)]
    return [(" ".join(rng.sample(words, 3)), " ".join(rng.sample(words, rng.randint(3, 20)))) for _ in range(n)]


def test_one_logit_head_gets_levels_and_cut_points(tmp_path):
    src = tmp_path / "xlmr"
    build_reference("xlm-roberta", src, 1, seed=2)
    data = pairs(240)
    model = RelevanceModel.load(src)
    z = model.encoded_logits(model.encode(data), raw=True)[:, 0]
    terciles = torch.quantile(z, torch.tensor([1 / 3, 2 / 3]))
    truth = torch.bucketize(z, terciles, right=True) + 1  # levels 1..3, rising with the logit
    with (tmp_path / "dev.csv").open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["query", "title", "level"])
        w.writerows([q, t, int(y)] for (q, t), y in zip(data, truth))
    report = calibrate(src, tmp_path / "dev.csv", tmp_path / "out", levels=["1", "2", "3"])
    assert report["head"] == "logit" and report["levels"] == ["1", "2", "3"] and report["qwk_cuts"] > 0.95
    cal = RelevanceModel.load(tmp_path / "out")
    assert cal.labels == ["1", "2", "3"] and cal.head.kind == "logit"
    s = cal.score(cal.encoded_logits(cal.encode(data)))
    torch.testing.assert_close(s.expected, 1 + 2 * torch.sigmoid(z), atol=1e-5, rtol=0)
    assert (s.level + 1 == truth).double().mean() > 0.95
    with pytest.raises(ValueError, match="one-logit head is calibrated by its levels"):
        calibrate(src, tmp_path / "dev.csv", tmp_path / "bad", levels=["1", "2", "3"], bias=True)
