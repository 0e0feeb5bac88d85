"""The shipped models grade as their model card says: unrelated titles low, every level in use, the level
rule stored in the checkpoint. Real weights, real data; a handful of seconds per model."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from model.data import read_labelled
from model.relevance import RelevanceModel
from model.train.evaluate import metrics_of, negatives_report, score_dataset
from model.train.negatives import sample_negatives
from tests.conftest import shared_data

ROOT = Path(__file__).resolve().parent.parent.parent
OFF_DOMAIN = ROOT / "tests" / "data" / "off_domain_titles.csv"
SHIPPED = ["default", "pruned"]


@pytest.fixture(scope="module", params=SHIPPED)
def shipped(request) -> RelevanceModel:
    return RelevanceModel.load(ROOT / "model" / request.param)


def test_titles_from_other_shops_are_graded_unrelated(shipped):
    with OFF_DOMAIN.open(encoding="utf-8") as f:
        pairs = [(r["query"], r["title"]) for r in csv.DictReader(f)]
    got = shipped.predict(pairs)
    levels = [shipped.labels[p.level] for p in got]
    bad = [(q, t, lv, round(p.expected, 2)) for (q, t), p, lv in zip(pairs, got, levels) if lv not in ("1", "2")]
    # Of the 100, v3 grades 99 at level 1-2 (default and pruned), the last at 3 ("Wireless computer mouse"
    # for "door lock": 3.34 / 3.55); v2.1 graded 98 and 97 (docs/model-card.md; issue 23 asks for all 100)
    assert len(pairs) == 100 and len(bad) <= 3, bad
    assert all(lv in ("1", "2", "3") for lv in levels), bad  # none at 4-5, whatever the model's cut points
    # the level-1 cut (set from sampled negatives) puts 92 (default) and 93 (pruned) at level 1; v2.1 87 / 88
    assert sum(lv == "1" for lv in levels) >= 85


def test_the_off_domain_set_spans_the_domains_and_is_not_in_the_training_data():
    with OFF_DOMAIN.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len({(r["query"], r["title"]) for r in rows}) == 100
    domains = {r["domain"] for r in rows}
    assert {"books", "food", "clothing", "electronics", "toys", "services"} <= domains
    titles = {" ".join(r["title"].lower().split()) for r in rows}
    for name in ("train.csv", "dev.csv"):  # kept out of training, and out of the catalogue negatives
        with shared_data("homedepot", name).open(encoding="utf-8") as f:
            assert not titles & {" ".join(r["title"].lower().split()) for r in csv.DictReader(f)}


def test_the_quick_start_example(shipped):
    drill, hose = shipped.predict(
        [("cordless drill", "DEWALT 20V MAX Cordless Drill/Driver Kit"), ("cordless drill", "50 ft. Garden Hose")]
    )
    levels = shipped.labels[drill.level], shipped.labels[hose.level]
    assert levels[0] in ("4", "5") and levels[1] in ("1", "2") and drill.expected > hose.expected + 1.0


def test_the_level_rule_is_stored_and_every_level_is_used_on_dev(shipped):
    dev = shared_data("homedepot", "dev.csv")
    assert shipped.rule.cuts is not None
    ds = read_labelled(dev, shipped.labels)
    ds.examples = ds.examples[:2000]
    scored = score_dataset(shipped, ds.examples)
    shares = torch.bincount(scored.level, minlength=5).double() / len(ds)
    assert (shares >= 0.015).all(), shares.tolist()  # >= 2% on the whole of dev (docs/model-card.md)
    assert metrics_of(ds, scored)["qwk"] > 0.4
    negs = sample_negatives(ds, 0.5, seed=0)
    neg = negatives_report(ds, scored, negs, score_dataset(shipped, negs))
    assert neg["level12_share"] >= 0.93 and neg["auc"] >= 0.97, neg
    assert neg["level1_share"] >= 0.9, neg  # v3: 95% of dev's negatives (the cut is set there)
