"""Temperature scaling (Guo et al., 2017): one scalar T fitted for log-loss on held-out labelled pairs,
folded into the head (W/T, b/T), so the calibrated checkpoint is a plain checkpoint. The argmax level,
and so accuracy, F1 and QWK, cannot change; probabilities and the expected level do."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import Tensor

from model.bert import BertForRelevance
from model.classifier import RelevanceModel
from model.data import Dataset


def dataset_logits(model: RelevanceModel, ds: Dataset) -> Tensor:
    return model.encoded_logits(model.encode(ds.pairs))


def fit_temperature(logits: Tensor, labels: Tensor, lo: float = 0.05, hi: float = 20.0, iters: int = 60) -> float:
    """The T minimising cross-entropy of logits / T; golden-section search on log T (the loss is
    unimodal in T)."""
    def loss(log_t: float) -> float:
        return torch.nn.functional.cross_entropy(logits / math.exp(log_t), labels).item()

    a, b = math.log(lo), math.log(hi)
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = loss(d)
    return math.exp((a + b) / 2)


@torch.no_grad()
def fold_temperature(module: BertForRelevance, t: float) -> None:
    """Divide the head by T in place and record the cumulative temperature in the config."""
    module.classifier.weight.div_(t)
    module.classifier.bias.div_(t)
    total = float(module.cfg.extra.get("qtrel_temperature", 1.0)) * t
    module.cfg = replace(module.cfg, extra={**module.cfg.extra, "qtrel_temperature": round(total, 6)})
