"""Graded-relevance metrics, in plain Python so they can be checked by hand.

Labels are class indices 0..K-1 (level k+1). Scores are expected levels (floats that rank).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence


def confusion(y_true: Sequence[int], y_pred: Sequence[int], k: int) -> list[list[int]]:
    """k x k counts, rows = true class, columns = predicted class."""
    m = [[0] * k for _ in range(k)]
    for t, p in zip(y_true, y_pred):
        m[t][p] += 1
    return m


def accuracy(y_true: Sequence[int], y_pred: Sequence[int]) -> float:
    return sum(t == p for t, p in zip(y_true, y_pred)) / len(y_true)


def per_class(y_true: Sequence[int], y_pred: Sequence[int], k: int) -> list[dict[str, float]]:
    """Precision, recall, F1 and support per class (0 where undefined)."""
    m = confusion(y_true, y_pred, k)
    rows = []
    for c in range(k):
        tp = m[c][c]
        pred = sum(m[r][c] for r in range(k))
        true = sum(m[c])
        p = tp / pred if pred else 0.0
        r = tp / true if true else 0.0
        f = 2 * p * r / (p + r) if p + r else 0.0
        rows.append({"precision": p, "recall": r, "f1": f, "support": true, "predicted": pred})
    return rows


def macro_f1(y_true: Sequence[int], y_pred: Sequence[int], k: int) -> float:
    """Mean F1 over the classes that occur in the truth or the predictions (scikit-learn's rule)."""
    present = set(y_true) | set(y_pred)
    rows = per_class(y_true, y_pred, k)
    return sum(rows[c]["f1"] for c in present) / len(present)


def quadratic_kappa(y_true: Sequence[int], y_pred: Sequence[int], k: int) -> float:
    """Cohen's kappa with quadratic weights (w_ij = (i-j)^2 / (k-1)^2)."""
    n = len(y_true)
    m = confusion(y_true, y_pred, k)
    row = [sum(r) for r in m]
    col = [sum(m[i][j] for i in range(k)) for j in range(k)]
    num = den = 0.0
    for i in range(k):
        for j in range(k):
            w = (i - j) ** 2 / (k - 1) ** 2
            num += w * m[i][j]
            den += w * row[i] * col[j] / n
    return 1.0 - num / den if den else 1.0


def rmse(a: Sequence[float], b: Sequence[float]) -> float:
    return math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)) / len(a))


def ndcg_at(k: int, gains: Sequence[float], scores: Sequence[float]) -> float | None:
    """NDCG@k of one query's results ranked by score; gain 2^g - 1. None when every gain is 0."""
    ideal = sorted(gains, reverse=True)[:k]
    idcg = sum((2**g - 1) / math.log2(i + 2) for i, g in enumerate(ideal))
    if idcg == 0:
        return None
    # Ties in score are broken by position in the input, so the result is deterministic.
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
    dcg = sum((2 ** gains[j] - 1) / math.log2(i + 2) for i, j in enumerate(ranked))
    return dcg / idcg


def mean_ndcg(queries: Sequence[str], y_true: Sequence[int], scores: Sequence[float], k: int = 10) -> float:
    """NDCG@k averaged over queries; the graded gain of class c is c (level 1 gains nothing)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, q in enumerate(queries):
        groups[q].append(i)
    vals = []
    for idx in groups.values():
        v = ndcg_at(k, [y_true[i] for i in idx], [scores[i] for i in idx])
        if v is not None:
            vals.append(v)
    return sum(vals) / len(vals) if vals else 0.0


def reliability(probs: Sequence[Sequence[float]], y_true: Sequence[int], bins: int = 10) -> list[dict]:
    """Per level k: the pairs binned by predicted p(k) into `bins` equal-width bins, each bin's mean
    predicted probability, observed frequency of level k and count; and the expected calibration error
    (the count-weighted mean gap). A calibrated model's bins lie on the diagonal."""
    k = len(probs[0]) if probs else 0
    out = []
    for c in range(k):
        sums = [[0.0, 0.0, 0] for _ in range(bins)]
        for p, y in zip(probs, y_true):
            b = sums[min(int(p[c] * bins), bins - 1)]
            b[0] += p[c]
            b[1] += 1.0 if y == c else 0.0
            b[2] += 1
        rows = [
            {"lo": i / bins, "hi": (i + 1) / bins, "predicted": s[0] / s[2], "observed": s[1] / s[2], "n": s[2]}
            for i, s in enumerate(sums)
            if s[2]
        ]
        n = sum(r["n"] for r in rows)
        ece = sum(r["n"] * abs(r["predicted"] - r["observed"]) for r in rows) / n if n else 0.0
        out.append({"bins": rows, "ece": ece})
    return out


def all_metrics(
    queries: Sequence[str],
    y_true: Sequence[int],
    y_pred: Sequence[int],
    scores: Sequence[float],
    k: int,
    relevance: Sequence[float | None] | None = None,
) -> dict:
    """Every metric of `qtrel eval`. `scores` are expected levels on the 1..k scale."""
    out = {
        "n": len(y_true),
        "accuracy": accuracy(y_true, y_pred),
        "macro_f1": macro_f1(y_true, y_pred, k),
        "qwk": quadratic_kappa(y_true, y_pred, k),
        "rmse_level": rmse(scores, [t + 1 for t in y_true]),
        "ndcg@10": mean_ndcg(queries, y_true, scores, 10),
        "per_level": per_class(y_true, y_pred, k),
        "confusion": confusion(y_true, y_pred, k),
    }
    known = [r for r in relevance if r is not None] if relevance is not None else []
    if relevance is not None and len(known) == len(relevance):  # every pair has a relevance
        # Home Depot's 1..3 scale: relevance ~ 1 + (E[level] - 1) / 2 for five levels.
        span = (k - 1) / 2
        out["rmse_relevance"] = rmse([1 + (s - 1) / span for s in scores], known)
    return out
