"""Calibration of a one-logit head (model.heads): its levels and the cut points that grade them, fitted on
held-out labelled pairs. The logit's sigmoid stays the 0..1 score; the head's expected level becomes
lo + (hi - lo) * sigmoid(z) on the data's levels, and the cut points on it are fitted for quadratic weighted
kappa (model.scoring.fit_cuts), each level given to at least `min_share` of the pairs. Stored in config.json
as `qtrel_levels` and `qtrel_level_cuts`; the weights are kept as they are."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from model.checkpoint import load_network, save_checkpoint
from model.data import read_labelled
from model.heads import levels_of
from model.levels import level_numbers
from model.relevance import RelevanceModel
from model.scoring import LevelRule, fit_cuts
from model.tokenizer import PairTokenizer
from model.train.metrics import quadratic_kappa


def calibrate_logit_head(
    model_dir: str | Path,
    data_file: str | Path,
    out: str | Path,
    levels: Sequence[str] | None = None,
    min_share: float = 0.02,
) -> dict:
    """Fit `levels` (lowest first; default: the head's own, "0" and "1") and their cut points on `data_file`;
    write the checkpoint to `out`."""
    module = load_network(model_dir)
    model = RelevanceModel(module, PairTokenizer.from_dir(model_dir), onednn=False, unpadded=False)
    if model.head.kind != "logit":
        raise ValueError(f"{model_dir} has a {len(model.labels)}-level head: calibrate it without --levels")
    labels = [str(x) for x in (levels or model.labels)]
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise ValueError(f"--levels must name at least two distinct levels, got {labels}")
    ds = read_labelled(data_file, labels)
    enc = model.encode([(e.query, e.title) for e in ds.examples])
    z = model.encoded_logits(enc, raw=True)[:, 0]
    values = level_numbers(labels)
    lo, hi = min(values), max(values)
    expected = lo + (hi - lo) * torch.sigmoid(z)
    k = len(labels)
    rule = LevelRule(fit_cuts(expected.tolist(), ds.labels, k, min_share))
    module.cfg = replace(module.cfg, extra={**module.cfg.extra, **levels_of(labels), **rule.to_extra()})
    save_checkpoint(module, model.tokenizer, out)
    return {
        "head": "logit",
        "levels": labels,
        "level_cuts": rule.to_extra()["qtrel_level_cuts"],
        "qwk_cuts": round(quadratic_kappa(ds.labels, rule.levels(torch.empty(0), expected).tolist(), k), 4),
        "pairs": len(ds),
        "out": str(out),
    }
