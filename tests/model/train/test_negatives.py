"""Sampled negatives: never a title judged for the same query, deterministic, the asked-for count."""

from __future__ import annotations

import re

import pytest

from model.data import Dataset, Example, read_labelled
from model.tokenizer import PairTokenizer
from model.train.negatives import (
    GENERIC_WORDS,
    hard_candidates,
    head_term,
    judged_titles,
    sample_foreign_negatives,
    sample_hard_negatives,
    sample_negatives,
    vocabulary_words,
    with_negatives,
)
from tests.conftest import ROOT, shared_data

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


def test_head_term_is_the_last_word_before_a_with_clause():
    assert head_term("cordless drill") == "drill"
    assert head_term("1 1/2' junction box with clamps") == "box"
    assert head_term("deck screws") == "screw"
    assert head_term("48x 34 shower w/seat") == "shower"
    assert head_term("2 x 4") is None


def test_hard_negatives_share_a_word_lack_the_head_term_and_were_never_judged():
    ds = Dataset(
        [
            Example("cordless drill", "DEWALT 20V Cordless Drill Kit", 4, relevance=3.0),
            Example("cordless drill", "Ryobi drill bits", 3, relevance=2.0),
            Example("impact driver", "Milwaukee M18 cordless impact driver", 4, relevance=3.0),
            Example("drills", "Makita cordless drill driver", 4, relevance=3.0),
            Example("garden hose", "50 ft. Garden Hose", 4, relevance=3.0),
            Example("garden hose", "cordless leaf blower", 1, relevance=1.33),
        ]
    )
    cands = hard_candidates(ds)
    # shares "cordless", lacks "drill"; the leaf blower too; never the judged kit or a drill title
    assert cands["cordless drill"] == ["Milwaukee M18 cordless impact driver", "cordless leaf blower"]
    assert "drills" not in cands  # one word, which is its head term: nothing to share
    negs = sample_hard_negatives(ds, 2.0, seed=0)
    assert len(negs) == 12 and all(n.label == 0 and n.relevance == 1.0 for n in negs)
    for n in negs:
        assert n.title in cands[" ".join(n.query.lower().split())]


def test_a_typo_of_the_head_term_is_still_the_head_term():
    ds = Dataset(
        [
            Example("sanding sponce", "3M Medium Sanding Sponge", 4),
            Example("sanding discs", "orbital sanding discs", 4),
            Example("belt sander", "belt sanding belts", 3),
        ]
    )
    assert "3M Medium Sanding Sponge" not in hard_candidates(ds).get("sanding sponce", [])


def test_a_hard_share_of_the_negatives_on_the_real_catalogue(train):
    both = with_negatives(train, 0.6, seed=0, hard=0.25)
    negs = both.examples[len(train) :]
    assert len(negs) == round(0.6 * len(train))
    judged = judged_titles(train)
    for n in negs:
        assert " ".join(n.title.lower().split()) not in judged[" ".join(n.query.lower().split())]
    plain = with_negatives(train, 0.6, seed=0)
    assert plain.examples == with_negatives(train, 0.6, seed=0, hard=0.0).examples  # no share: as before
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        with_negatives(train, 0.6, seed=0, hard=1.5)


def test_foreign_negatives_keep_a_titles_shape_and_use_no_word_of_the_query(train):
    words = vocabulary_words(PairTokenizer.from_dir(ROOT / "model" / "default").vocabulary())
    assert "drill" in words and not any(w.startswith("##") or w.startswith("[") for w in words)
    own = {w for e in train.examples for w in re.findall(r"[a-z]+", e.title.lower())}
    negs = sample_foreign_negatives(train, 0.2, seed=3, words=words)
    assert len(negs) == round(0.2 * len(train)) and all(n.label == 0 and n.relevance == 1.0 for n in negs)
    titles = {e.title for e in train.examples}
    foreign_words = 0
    for n in negs:
        assert n.title not in titles
        query_words = set(re.findall(r"[a-z]+", n.query.lower()))
        title_words = re.findall(r"[a-z]{3,}", n.title.lower())
        assert not (set(title_words) & query_words) - GENERIC_WORDS  # only a unit the title had may remain
        foreign_words += sum(w not in own for w in title_words)
        assert all(w in own or w in words for w in title_words)
    assert foreign_words > 0.5 * sum(len(re.findall(r"[a-z]{3,}", n.title.lower())) for n in negs)
    # numbers and units stay: the titles keep a catalogue title's shape
    assert sum(bool(re.search(r"\d", n.title)) for n in negs) > 0.5 * len(negs)
    again = sample_foreign_negatives(train, 0.2, seed=3, words=words)
    assert [(n.query, n.title) for n in again] == [(n.query, n.title) for n in negs]


def test_foreign_share_of_the_negatives_and_its_bounds(train):
    words = vocabulary_words(PairTokenizer.from_dir(ROOT / "model" / "default").vocabulary())
    both = with_negatives(train, 0.5, seed=0, hard=0.3, foreign=0.2, words=words)
    negs = both.examples[len(train) :]
    assert len(negs) == round(0.5 * len(train))
    assert sum(n.title not in {e.title for e in train.examples} for n in negs) == round(0.5 * 0.2 * len(train))
    with pytest.raises(ValueError, match="sum to at most 1"):
        with_negatives(train, 0.5, seed=0, hard=0.6, foreign=0.5, words=words)
    with pytest.raises(ValueError, match="vocabulary words outside"):
        sample_foreign_negatives(train, 0.1, seed=0, words=["drill"])
