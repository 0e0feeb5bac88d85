"""Sampled negatives: never a title judged for the same query, deterministic, the asked-for count."""

from __future__ import annotations

import pytest

from model.data import Dataset, Example, read_labelled
from model.negatives import judged_titles, sample_negatives, with_negatives
from tests.conftest import shared_data

LEVELS = ["1", "2", "3", "4", "5"]


@pytest.fixture(scope="module")
def train() -> Dataset:
    ds = read_labelled(shared_data("homedepot", "train.csv"), LEVELS)  # the sampler is tested on the real catalogue
    ds.examples = ds.examples[:5000]
    return ds


def test_never_draws_a_title_judged_for_the_same_query(train):
    judged = judged_titles(train)
    negs = sample_negatives(train, 2.0, seed=1)
    assert len(negs) == 2 * len(train)
    for n in negs:
        assert " ".join(n.title.lower().split()) not in judged[" ".join(n.query.lower().split())]
        assert n.label == 0 and n.relevance == 1.0


def test_same_title_judged_under_another_spelling_of_the_query_is_excluded():
    # "Drill" and "drill " are the same query; the hammer is judged for it, so it is never its negative
    ds = Dataset(
        [
            Example("Drill", "DEWALT hammer", 4),
            Example("drill ", "cordless drill", 4),
            Example("hose", "garden hose", 4),
            Example("hose", "hose reel", 3),
        ]
    )
    for seed in range(30):
        for n in sample_negatives(ds, 3.0, seed=seed):
            if n.query.strip().lower() == "drill":
                assert n.title in ("garden hose", "hose reel")
            else:
                assert n.title in ("DEWALT hammer", "cordless drill")


def test_deterministic_per_seed_and_fresh_across_seeds(train):
    a = [(e.query, e.title) for e in sample_negatives(train, 0.3, seed=5)]
    b = [(e.query, e.title) for e in sample_negatives(train, 0.3, seed=5)]
    c = [(e.query, e.title) for e in sample_negatives(train, 0.3, seed=6)]
    assert a == b and a != c and len(a) == round(0.3 * len(train))


def test_with_negatives_appends_and_zero_adds_nothing(train):
    assert len(with_negatives(train, 0.0, seed=0)) == len(train)
    both = with_negatives(train, 0.5, seed=0)
    assert both.examples[: len(train)] == train.examples and len(both) == len(train) + round(0.5 * len(train))
    with pytest.raises(ValueError, match=">= 0"):
        sample_negatives(train, -1, seed=0)
