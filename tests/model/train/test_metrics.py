"""Metrics against values worked out by hand, then against scikit-learn on random data."""

from __future__ import annotations

import math
import random

import pytest

from model.train.metrics import (
    accuracy,
    all_metrics,
    confusion,
    macro_f1,
    mean_ndcg,
    ndcg_at,
    per_class,
    quadratic_kappa,
    rmse,
)

# Five levels (classes 0..4). Pairs (true, pred): (0,0) (1,2) (2,2) (2,1) (4,4).
Y_TRUE = [0, 1, 2, 2, 4]
Y_PRED = [0, 2, 2, 1, 4]


def test_confusion():
    assert confusion(Y_TRUE, Y_PRED, 5) == [
        [1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1],
    ]


def test_accuracy():
    # Right at positions 0, 2 and 4: 3 / 5.
    assert accuracy(Y_TRUE, Y_PRED) == pytest.approx(0.6)
    assert accuracy([3], [3]) == 1.0
    assert accuracy([3, 1], [1, 3]) == 0.0


def test_per_class_and_macro_f1():
    # class 0: tp 1, predicted 1, true 1 -> P 1, R 1, F1 1
    # class 1: tp 0 (its one pair was called 2), predicted 1 (pair 3, truly 2) -> P 0, R 0, F1 0
    # class 2: true at 2 and 3, predicted at 1 and 2, tp 1 -> P 1/2, R 1/2, F1 1/2
    # class 3: in neither truth nor predictions -> left out of the mean
    # class 4: tp 1 -> F1 1
    # macro-F1 = (1 + 0 + 1/2 + 1) / 4 = 0.625
    rows = per_class(Y_TRUE, Y_PRED, 5)
    assert [r["f1"] for r in rows] == pytest.approx([1.0, 0.0, 0.5, 0.0, 1.0])
    assert [r["support"] for r in rows] == [1, 1, 2, 0, 1]
    assert rows[2]["precision"] == pytest.approx(0.5) and rows[2]["recall"] == pytest.approx(0.5)
    assert macro_f1(Y_TRUE, Y_PRED, 5) == pytest.approx(0.625)


def test_macro_f1_counts_a_class_only_predicted():
    # true [0, 0], pred [0, 1]: class 0 P 1, R 1/2, F1 = 2 * 1 * 1/2 / (3/2) = 2/3; class 1 P 0 -> F1 0.
    # Both classes occur, so the mean is (2/3 + 0) / 2 = 1/3.
    assert macro_f1([0, 0], [0, 1], 5) == pytest.approx(1 / 3)


def test_quadratic_kappa():
    # Weights w_ij = (i - j)^2 / 16. Observed: the two off-diagonal pairs (1,2) and (2,1) cost 1/16 each,
    # num = 2/16. Row and column totals are both v = [1, 1, 2, 0, 1], n = 5; expected
    # den = sum_ij (i-j)^2 v_i v_j / 16 / 5. Over i < j: (0,1) 1*1*1 = 1, (0,2) 4*1*2 = 8, (0,4) 16*1*1 = 16,
    # (1,2) 1*1*2 = 2, (1,4) 9*1*1 = 9, (2,4) 4*2*1 = 8; sum 44, both orders 88 -> den = 88 / 80.
    # kappa = 1 - (2/16) / (88/80) = 1 - 160/1408 = 1 - 10/88 = 39/44.
    assert quadratic_kappa(Y_TRUE, Y_PRED, 5) == pytest.approx(39 / 44)


def test_quadratic_kappa_extremes():
    assert quadratic_kappa([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 5) == pytest.approx(1.0)
    # Fully reversed over two classes: num = 2 * 1 (weight 1/1) -> 2; rows = cols = [1, 1], den = 2*1*1/2 = 1
    # -> kappa = 1 - 2 / 1 = -1.
    assert quadratic_kappa([0, 1], [1, 0], 2) == pytest.approx(-1.0)
    # Every answer the same class in both: nothing to disagree about, defined as 1.
    assert quadratic_kappa([2, 2], [2, 2], 5) == 1.0


def test_rmse():
    # Differences 1, 0, 2 -> squares 1, 0, 4 -> mean 5/3 -> sqrt(5/3).
    assert rmse([1, 2, 3], [2, 2, 5]) == pytest.approx(math.sqrt(5 / 3))
    assert rmse([1.5], [1.5]) == 0.0


def test_ndcg_by_hand():
    # Gains (class index) 2, 0, 1 scored 0.1, 0.9, 0.5 -> ranked: item 1 (gain 0), item 2 (1), item 0 (2).
    # DCG = (2^0-1)/log2(2) + (2^1-1)/log2(3) + (2^2-1)/log2(4) = 0 + 1/log2(3) + 3/2
    # IDCG (gains 2, 1, 0) = 3/1 + 1/log2(3) + 0
    dcg = 1 / math.log2(3) + 1.5
    idcg = 3 + 1 / math.log2(3)
    assert ndcg_at(10, [2, 0, 1], [0.1, 0.9, 0.5]) == pytest.approx(dcg / idcg)  # 0.5869
    # Cut at 2: DCG = 0 + 1/log2(3); IDCG = 3 + 1/log2(3).
    assert ndcg_at(2, [2, 0, 1], [0.1, 0.9, 0.5]) == pytest.approx((1 / math.log2(3)) / idcg)  # 0.1738
    assert ndcg_at(10, [2, 0, 1], [0.9, 0.1, 0.5]) == pytest.approx(1.0)


def test_ndcg_cuts_at_ten():
    # Twelve results; the only relevant one (gain 1 -> 2^1-1 = 1) is ranked 11th: outside the top 10 -> 0.
    gains = [0] * 10 + [1, 0]
    scores = [float(12 - i) for i in range(12)]
    assert ndcg_at(10, gains, scores) == 0.0
    # Ranked 10th instead: DCG = 1/log2(11), IDCG = 1/log2(2) = 1.
    assert ndcg_at(10, [0] * 9 + [1, 0, 0], scores) == pytest.approx(1 / math.log2(11))


def test_ndcg_ties_follow_input_order():
    # Equal scores keep input order: item 0 (gain 0) first, item 1 (gain 3 -> 7) second.
    # DCG = 7/log2(3), IDCG = 7/1 -> 1/log2(3) = 0.6309.
    assert ndcg_at(10, [0, 3], [0.5, 0.5]) == pytest.approx(1 / math.log2(3))


def test_ndcg_undefined_without_relevant_results():
    assert ndcg_at(10, [0, 0, 0], [0.3, 0.2, 0.1]) is None


def test_mean_ndcg_skips_queries_with_nothing_relevant():
    # Query a: the case worked out above; query b: every gain 0, left out; query c: perfect (1.0).
    queries = ["a", "a", "a", "b", "b", "c", "c"]
    y_true = [2, 0, 1, 0, 0, 4, 1]
    scores = [0.1, 0.9, 0.5, 0.3, 0.2, 0.8, 0.1]
    a = (1 / math.log2(3) + 1.5) / (3 + 1 / math.log2(3))
    assert mean_ndcg(queries, y_true, scores) == pytest.approx((a + 1.0) / 2)
    assert mean_ndcg(["b", "b"], [0, 0], [0.1, 0.2]) == 0.0


def test_all_metrics():
    # Expected levels 1, 5, 3 for truths level 1, 5, 4 (classes 0, 4, 3).
    # rmse_level: differences 0, 0, -1 -> sqrt(1/3).
    # rmse_relevance: 1 + (s - 1) / 2 -> 1, 3, 2 against 1, 3, 2.5 -> differences 0, 0, -0.5 -> sqrt(0.25/3).
    m = all_metrics(["q", "q", "r"], [0, 4, 3], [0, 4, 2], [1.0, 5.0, 3.0], 5, relevance=[1.0, 3.0, 2.5])
    assert m["n"] == 3
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert m["rmse_level"] == pytest.approx(math.sqrt(1 / 3))
    assert m["rmse_relevance"] == pytest.approx(math.sqrt(0.25 / 3))
    # Query q: gains 0 and 4 ranked 5.0 first -> perfect; query r: one result -> perfect.
    assert m["ndcg@10"] == pytest.approx(1.0)
    assert m["confusion"][3][2] == 1
    assert "rmse_relevance" not in all_metrics(["q"], [0], [0], [1.0], 5, relevance=[None])
    assert "rmse_relevance" not in all_metrics(["q"], [0], [0], [1.0], 5)


# --- scikit-learn as a second opinion -----------------------------------------------------------------
def random_labels(rng: random.Random, n: int, k: int) -> tuple[list[int], list[int]]:
    """Skewed labels, so that some classes are often absent, with predictions near the truth."""
    weights = [rng.random() ** 3 for _ in range(k)]
    y_true = rng.choices(range(k), weights, k=n)
    y_pred = [min(k - 1, max(0, t + rng.choice([-2, -1, 0, 0, 0, 1]))) for t in y_true]
    return y_true, y_pred


def test_qwk_and_macro_f1_match_scikit_learn():
    sk = pytest.importorskip("sklearn.metrics")
    rng = random.Random(0)
    for trial in range(200):
        k = rng.choice([2, 3, 5])
        y_true, y_pred = random_labels(rng, rng.randint(5, 60), k)
        if len(set(y_true) | set(y_pred)) > 1:
            want = sk.cohen_kappa_score(y_true, y_pred, labels=list(range(k)), weights="quadratic")
            assert quadratic_kappa(y_true, y_pred, k) == pytest.approx(want, abs=1e-9), trial
        want = sk.f1_score(y_true, y_pred, average="macro", zero_division=0)
        assert macro_f1(y_true, y_pred, k) == pytest.approx(want, abs=1e-9), trial
        assert accuracy(y_true, y_pred) == pytest.approx(sk.accuracy_score(y_true, y_pred)), trial


def test_reliability_bins_predicted_against_observed_and_its_ece():
    from model.train.metrics import reliability

    rng = random.Random(0)
    probs, ys = [], []
    for _ in range(20000):  # calibrated by construction: y drawn from p
        a = rng.random()
        p = [a, 1 - a]
        probs.append(p)
        ys.append(0 if rng.random() < a else 1)
    cal = reliability(probs, ys, bins=10)
    assert len(cal) == 2 and cal[0]["ece"] < 0.02
    assert sum(b["n"] for b in cal[0]["bins"]) == 20000
    # overconfident: says 0.95 where the truth is 0.5
    over = reliability([[0.95, 0.05]] * 1000, [0, 1] * 500, bins=10)
    (b,) = over[0]["bins"]
    assert (b["lo"], b["hi"], b["observed"], b["n"]) == (0.9, 1.0, 0.5, 1000)
    assert b["predicted"] == pytest.approx(0.95) and over[0]["ece"] == pytest.approx(0.45)


def test_same_query_auc_counts_wins_and_half_ties_within_a_query_only():
    from model.train.evaluate import same_query_auc

    # query a: judged 0.9 and 0.5 against negatives 0.5 and 0.1 -> wins 1 + 1 + 0.5 + 1 of 4; query b's negative
    # 0.95 is never compared with a's pairs, and b's judged pair has no negative of its own
    auc = same_query_auc(["a", "a", "b"], [0.9, 0.5, 0.2], ["a", "a", "c"], [0.5, 0.1, 0.95])
    assert auc == 3.5 / 4
    assert math.isnan(same_query_auc(["a"], [0.5], ["b"], [0.1]))
