"""Evaluation of a relevance model on a labelled file: the `qtrel eval` metrics."""

from __future__ import annotations

from model.classifier import RelevanceModel
from model.data import Dataset
from model.metrics import all_metrics


def evaluate(model: RelevanceModel, ds: Dataset, max_batch_tokens: int = 8192) -> dict:
    preds = model.predict(ds.pairs, max_batch_tokens=max_batch_tokens)
    index = {lab: i for i, lab in enumerate(model.labels)}
    return all_metrics(
        queries=[e.query for e in ds.examples],
        y_true=ds.labels,
        y_pred=[index[p.level] for p in preds],
        # Expected level on the 1..k rank scale, whatever the labels' own values.
        scores=[sum((i + 1) * q for i, q in enumerate(p.probs)) for p in preds],
        k=len(model.labels),
        relevance=[e.relevance for e in ds.examples],
    )
