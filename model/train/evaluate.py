"""Evaluation of a relevance model on a labelled file: the `qtrel eval` metrics, and how it grades
unrelated titles (sampled negatives)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from torch import Tensor

from model.data import Dataset, Example
from model.levels import MAX_BATCH_TOKENS, ScoredBatch
from model.relevance import RelevanceModel
from model.train.metrics import all_metrics


def metrics_of(ds: Dataset, scored: ScoredBatch[Tensor]) -> dict:
    """All metrics for the scored pairs of `ds` (levels by the model's rule, scores its expected
    level). The expected level is on the 1..k rank scale for the numeric Home Depot levels."""
    k = scored.probs.shape[1]
    return all_metrics(
        queries=[e.query for e in ds.examples],
        y_true=ds.labels,
        y_pred=scored.level.tolist(),
        scores=scored.expected.tolist(),
        k=k,
        relevance=[e.relevance for e in ds.examples],
    )


def score_dataset(
    model: RelevanceModel, examples: Sequence[Example], max_batch_tokens: int = MAX_BATCH_TOKENS
) -> ScoredBatch[Tensor]:
    enc = model.encode([(e.query, e.title) for e in examples])
    return model.score(model.encoded_logits(enc, max_batch_tokens))


def evaluate(model: RelevanceModel, ds: Dataset, max_batch_tokens: int = MAX_BATCH_TOKENS) -> dict:
    return metrics_of(ds, score_dataset(model, ds.examples, max_batch_tokens))


def negatives_report(
    ds: Dataset, judged: ScoredBatch[Tensor], negatives: Sequence[Example], neg: ScoredBatch[Tensor]
) -> dict:
    """How unrelated titles are graded: the share at the lowest level, at the lowest two, and the AUC of
    judged candidates against the negatives of the same query (ties count half)."""
    lv = neg.level
    auc = same_query_auc(
        [e.query for e in ds.examples], judged.expected.tolist(), [e.query for e in negatives], neg.expected.tolist()
    )
    return {
        "n": len(negatives),
        "level1_share": (lv == 0).float().mean().item(),
        "level12_share": (lv <= 1).float().mean().item(),
        "mean_score": neg.expected.mean().item(),
        "auc": auc,
    }


def same_query_auc(
    queries: Sequence[str], scores: Sequence[float], neg_queries: Sequence[str], neg_scores: Sequence[float]
) -> float:
    """AUC of judged candidates against the negatives of the same query (ties count half); NaN without any."""
    by_query: dict[str, list[float]] = defaultdict(list)
    for q, s in zip(neg_queries, neg_scores, strict=True):
        by_query[q].append(s)
    wins = total = 0.0
    for q, s in zip(queries, scores, strict=True):
        for n in by_query.get(q, ()):
            wins += 1.0 if s > n else 0.5 if s == n else 0.0
            total += 1
    return wins / total if total else float("nan")
