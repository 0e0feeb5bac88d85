"""Evaluation of a relevance model on a labelled file: the `qtrel eval` metrics."""

from __future__ import annotations

import torch

from model.classifier import RelevanceModel
from model.data import Dataset
from model.metrics import all_metrics


def metrics_from_probs(ds: Dataset, probs: torch.Tensor) -> dict:
    """All metrics for (n, levels) probabilities of `ds`'s pairs. The expected level is taken on the
    1..k rank scale, whatever the labels' own values."""
    k = probs.shape[1]
    ranks = torch.arange(1, k + 1, dtype=probs.dtype)
    return all_metrics(
        queries=[e.query for e in ds.examples],
        y_true=ds.labels,
        y_pred=probs.argmax(-1).tolist(),
        scores=(probs @ ranks).tolist(),
        k=k,
        relevance=[e.relevance for e in ds.examples],
    )


def evaluate(model: RelevanceModel, ds: Dataset, max_batch_tokens: int = 8192) -> dict:
    preds = model.predict(ds.pairs, max_batch_tokens=max_batch_tokens)
    return metrics_from_probs(ds, torch.tensor([p.probs for p in preds]))
