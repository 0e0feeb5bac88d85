"""The lexical baseline: features on hand-made pairs, a real fit that beats the majority class, refits."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from model.data import Dataset, Example, read_labelled
from model.train.baseline import (
    FEATURES,
    BaselineError,
    LexicalBaseline,
    TitleStats,
    char_ngrams,
    evaluate_baseline,
    pair_features,
    stem,
    tokens,
)
from model.train.metrics import all_metrics
from tests.conftest import shared_data

LEVELS = ["1", "2", "3", "4", "5"]
STATS = TitleStats(["Cordless Drill Kit", "Wood Deck Stain 1 gal.", "Copper Pipe 1/2 in. x 10 ft."])


def test_tokens_keep_numbers_and_split_units():
    assert tokens("BEHR 1-gal. #SC-141 125v 1/2 in. x 1.9 ft.") == [
        "behr",
        "1",
        "gal",
        "sc",
        "141",
        "125",
        "v",
        "1/2",
        "in",
        "x",
        "1.9",
        "ft",
    ]
    assert [stem(w) for w in ["drills", "batteries", "boxes", "glass", "sanding", "painted", "12s"]] == [
        "drill",
        "battery",
        "box",
        "glass",
        "sand",
        "paint",
        "12s",
    ]


def test_identical_pair_overlaps_fully():
    f = pair_features("Copper Pipe 1/2 in.", "Copper Pipe 1/2 in.", STATS)
    for name in (
        "exact_overlap",
        "stem_overlap",
        "prefix_overlap",
        "compact_overlap",
        "idf_overlap",
        "char3_jaccard",
        "char3_containment",
        "number_match",
        "bigram_overlap",
    ):
        assert f[name] == pytest.approx(1.0), name
    assert f["number_miss"] == 0 and f["first_match_pos"] == 0.0
    assert f["first_term_match"] == f["last_term_match"] == f["brand_match"] == 1.0
    assert f["bm25"] > 0


def test_disjoint_pair_overlaps_nowhere():
    f = pair_features("garden hose 50 ft", "Cordless Drill Kit 18V", STATS)
    for name in (
        "exact_overlap",
        "stem_overlap",
        "prefix_overlap",
        "compact_overlap",
        "idf_overlap",
        "bm25",
        "bm25_norm",
        "char3_jaccard",
        "number_match",
        "bigram_overlap",
        "first_term_match",
        "last_term_match",
        "brand_match",
    ):
        assert f[name] == 0.0, name
    assert math.isnan(f["first_match_pos"])
    assert f["q_numbers"] == 1 and f["number_miss"] == 1
    assert set(f) == set(FEATURES)


def test_partial_matches_are_graded():
    # "drills" matches "drill" only after stemming; "deckover" is found inside the compacted title.
    f = pair_features("cordless drills", "Cordless Drill Kit", STATS)
    assert f["exact_overlap"] == 0.5 and f["stem_overlap"] == 1.0
    f = pair_features("deck over", "BEHR DeckOver Wood Coating", STATS)
    assert f["exact_overlap"] == 0.0 and f["compact_overlap"] == 1.0
    assert pair_features("cordl", "Cordless Drill", STATS)["prefix_overlap"] == 1.0
    # No numbers in the query: number agreement is undefined, not zero.
    assert math.isnan(pair_features("drill", "Drill 18V", STATS)["number_match"])
    assert char_ngrams("ab") == {" ab", "ab "}


def test_bm25_prefers_rare_terms_and_short_titles():
    stats = TitleStats(["drill kit", "drill bit", "drill case", "hammer"])
    rare = pair_features("hammer", "hammer", stats)["bm25"]
    common = pair_features("drill", "drill", stats)["bm25"]
    assert rare > common > 0
    short = pair_features("drill", "drill kit", stats)["bm25"]
    long = pair_features("drill", "drill kit with case and bits and more", stats)["bm25"]
    assert short > long


def _slice(ds: Dataset, n: int) -> Dataset:
    return Dataset(ds.examples[:n], ds.path)


@pytest.fixture(scope="module")
def homedepot():
    train, dev = shared_data("homedepot", "train.csv"), shared_data("homedepot", "dev.csv")
    return read_labelled(train, LEVELS), read_labelled(dev, LEVELS)


@pytest.mark.timeout(60)
def test_beats_the_majority_class_on_real_data(homedepot):
    train, dev = _slice(homedepot[0], 3000), _slice(homedepot[1], 500)
    baseline = LexicalBaseline(LEVELS).fit(train)
    probs = baseline.predict_proba(dev.pairs[:7])
    assert probs.shape == (7, 5) and np.allclose(probs.sum(1), 1.0)

    m = evaluate_baseline(baseline, dev)
    counts = Counter(train.labels)
    majority = counts.most_common(1)[0][0]
    prior_mean = sum((c + 1) * n for c, n in counts.items()) / len(train)  # the best constant score
    queries = [e.query for e in dev.examples]
    ref = all_metrics(
        queries, dev.labels, [majority] * len(dev), [prior_mean] * len(dev), 5, [e.relevance for e in dev.examples]
    )
    assert m["accuracy"] > ref["accuracy"]
    assert m["macro_f1"] > ref["macro_f1"] + 0.1
    assert m["qwk"] > 0.1 > ref["qwk"]
    assert m["rmse_level"] < ref["rmse_level"] - 0.02
    assert m["rmse_relevance"] < ref["rmse_relevance"]
    # (NDCG is not compared: a constant score ranks each query's titles in file order.)


def _write_csv(path, rows):
    path.write_text("query,title,relevance,level\n" + "".join(f"{q},{t},{r},{lv}\n" for q, t, r, lv in rows))
    return path


def _toy_rows(n: int = 300):
    rng = np.random.default_rng(0)
    words = ["drill", "saw", "paint", "deck", "pipe", "copper", "light", "fan", "door", "tile"]
    rows = []
    for _ in range(n):
        q = " ".join(rng.choice(words, 2, replace=False))
        shared = int(rng.integers(0, 3))
        t = " ".join(list(q.split()[:shared]) + list(rng.choice(words, 3)))
        rows.append((q, t, 1 + shared, 2 * shared + 1))  # levels 1, 3, 5 only
    return rows


def test_save_load_refits_to_the_same_probabilities(tmp_path):
    train = _write_csv(tmp_path / "train.csv", _toy_rows())
    baseline = LexicalBaseline(LEVELS).fit_file(train)
    pairs = [("drill saw", "drill saw blade"), ("paint", "copper pipe")]
    probs = baseline.predict_proba(pairs)
    assert probs[:, [1, 3]].sum() == 0  # levels absent from training get no probability
    assert probs[0] @ np.arange(1, 6) > probs[1] @ np.arange(1, 6)

    baseline.save(tmp_path / "baseline.json")
    again = LexicalBaseline.load(tmp_path / "baseline.json")
    assert np.array_equal(again.predict_proba(pairs), probs)

    with train.open("a") as f:
        f.write("drill,drill,3,5\n")
    with pytest.raises(BaselineError, match="has changed"):
        LexicalBaseline.load(tmp_path / "baseline.json")


def test_refuses_what_it_cannot_fit(tmp_path):
    one_level = Dataset([Example("a", "a", 4), Example("b", "b", 4)])
    with pytest.raises(BaselineError, match="same level"):
        LexicalBaseline(LEVELS).fit(one_level)
    with pytest.raises(BaselineError, match="not fitted"):
        LexicalBaseline(LEVELS).predict_proba([("a", "b")])
    in_memory = LexicalBaseline(LEVELS).fit(Dataset([Example("a", "a", 4), Example("b", "c", 0)]))
    with pytest.raises(BaselineError, match="fit_file"):
        in_memory.save(tmp_path / "b.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(BaselineError, match="not a"):
        LexicalBaseline.load(tmp_path / "bad.json")
