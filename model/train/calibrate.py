"""Post-hoc calibration on held-out labelled pairs, stored in the checkpoint:

1. Temperature scaling (Guo et al., 2017): one scalar T fitted for log-loss, folded into the head
   (W/T, b/T), so the calibrated checkpoint is a plain checkpoint; the argmax cannot change.
2. The level rule (model.scoring): cut points on the calibrated expected level fitted for quadratic
   weighted kappa, with every level used for at least `min_share` of the pairs. Stored as
   `qtrel_level_cuts` in config.json and applied by the model wherever it scores.
3. Isotonic calibration of the score (`fit_isotonic`): a monotone map of the expected level to the
   raters' mean relevance, fitted on held-out pairs by pool-adjacent-violators, so that the score is an
   honest estimate (RMSE measured on it) while the ranking stays exactly as it was: the map is
   piecewise linear through the blocks' centres and strictly increasing, beyond them too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from model.bert import BertForRelevance
from model.checkpoint import load_config, load_module, save_checkpoint
from model.data import Dataset, Example, read_labelled
from model.relevance import RelevanceModel
from model.scoring import LevelRule, fit_cuts, merge_classes, score_logits
from model.tokenizer import PairTokenizer
from model.train.metrics import quadratic_kappa
from model.train.negatives import sample_negatives


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


def fit_vector_scaling(
    logits: Tensor, labels: Tensor, weights: Tensor | None = None, iters: int = 200
) -> tuple[float, Tensor]:
    """Temperature T and a bias per level b minimising weighted cross-entropy of logits / T + b (a
    diagonal-free variant of Guo et al.'s vector scaling: it corrects the level prior as well as the
    confidence). LBFGS on (log T, b); convex in b for fixed T and well behaved in practice."""
    w = torch.ones(len(labels)) if weights is None else weights
    log_t = torch.zeros(1, requires_grad=True)
    b = torch.zeros(logits.shape[1], requires_grad=True)
    opt = torch.optim.LBFGS([log_t, b], lr=0.5, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        nll = torch.nn.functional.cross_entropy(logits / log_t.exp() + b, labels, reduction="none")
        loss = (w * nll).sum() / w.sum()
        loss.backward()
        return loss

    opt.step(closure)
    return float(log_t.detach().exp()), (b - b.mean()).detach()


@torch.no_grad()
def fold_bias(module: BertForRelevance, b: Tensor) -> None:
    """Add a bias per level to the head in place, recorded in the config (cumulative)."""
    module.classifier.bias.add_(b.to(module.classifier.bias.dtype))
    prev = module.cfg.extra.get("qtrel_level_bias") or [0.0] * len(b)
    total = [round(float(x) + float(y), 6) for x, y in zip(prev, b.tolist())]
    module.cfg = replace(module.cfg, extra={**module.cfg.extra, "qtrel_level_bias": total})


@torch.no_grad()
def fold_temperature(module: BertForRelevance, t: float) -> None:
    """Divide the head by T in place and record the cumulative temperature in the config."""
    module.classifier.weight.div_(t)
    module.classifier.bias.div_(t)
    total = float(module.cfg.extra.get("qtrel_temperature", 1.0)) * t
    module.cfg = replace(module.cfg, extra={**module.cfg.extra, "qtrel_temperature": round(total, 6)})


# Slope of the isotonic map beyond its first and last knot: small, so that it stays strictly increasing.
END_SLOPE = 1e-3


def fit_isotonic(x: Sequence[float], y: Sequence[float]) -> tuple[list[float], list[float]]:
    """Knots (xs, ys) of the least-squares non-decreasing fit of y on x (pool-adjacent-violators): one
    knot per block, at the block's mean x and mean y; the ys increase strictly (equal blocks are pooled)."""
    if len(x) != len(y) or not x:
        raise ValueError("isotonic calibration needs as many targets as scores, and at least one")
    blocks: list[list[float]] = []  # [sum x, sum y, count], block means of y strictly increasing
    for i in sorted(range(len(x)), key=lambda i: x[i]):
        blocks.append([float(x[i]), float(y[i]), 1.0])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] >= blocks[-1][1] / blocks[-1][2]:
            sx, sy, n = blocks.pop()
            blocks[-1][0] += sx
            blocks[-1][1] += sy
            blocks[-1][2] += n
    xs, ys = [b[0] / b[2] for b in blocks], [b[1] / b[2] for b in blocks]
    for j in range(1, len(xs)):  # blocks of equal mean x (ties in the scores): keep the knots apart
        xs[j] = max(xs[j], xs[j - 1] + 1e-9)
    return xs, ys


def apply_isotonic(knots: tuple[Sequence[float], Sequence[float]], x: Tensor) -> Tensor:
    """The map at x: linear between knots, slope END_SLOPE beyond them; strictly increasing."""
    kx = torch.tensor(knots[0], dtype=torch.float64)
    ky = torch.tensor(knots[1], dtype=torch.float64)
    v = x.double()
    if len(kx) == 1:
        return (ky[0] + END_SLOPE * (v - kx[0])).to(x.dtype)
    j = torch.bucketize(v, kx).clamp(1, len(kx) - 1)  # the segment [kx[j-1], kx[j]] holding v
    x0, x1, y0, y1 = kx[j - 1], kx[j], ky[j - 1], ky[j]
    inside = y0 + (y1 - y0) * (v - x0) / (x1 - x0)
    out = torch.where(v < kx[0], ky[0] + END_SLOPE * (v - kx[0]), inside)
    out = torch.where(v > kx[-1], ky[-1] + END_SLOPE * (v - kx[-1]), out)
    return out.to(x.dtype)


def query_halves(ds: Dataset, seed: int = 0) -> tuple[list[int], list[int]]:
    """Indices of the pairs of a random half of the queries, and of the other half."""
    queries = sorted({e.query for e in ds.examples})
    random.Random(seed).shuffle(queries)
    half = set(queries[: len(queries) // 2])
    a = [i for i, e in enumerate(ds.examples) if e.query in half]
    return a, [i for i, e in enumerate(ds.examples) if e.query not in half]


def isotonic_rmse(ds: Dataset, expected: Tensor, k: int = 5, seed: int = 0) -> dict:
    """RMSE on the relevance scale of `ds` (every pair needs one) for the expected level over k levels
    mapped to it linearly (1 + (E - 1) / 2 for five, as `qtrel eval`), isotonically fitted and scored on all the
    pairs, and cross-fitted: fitted on one half of the queries and applied to the other, both ways."""
    rel = [e.relevance for e in ds.examples]
    if any(r is None for r in rel):
        raise ValueError("isotonic calibration to relevance needs a relevance on every pair")
    y = torch.tensor(rel, dtype=torch.float64)
    e = expected.double()
    span = (k - 1) / 2  # five levels: 1..5 -> 1..3

    def rmse(pred: Tensor, idx: list[int] | None = None) -> float:
        t = y if idx is None else y[idx]
        return float((pred - t).pow(2).mean().sqrt())

    knots = fit_isotonic(e.tolist(), y.tolist())
    crossed = torch.empty_like(y)
    for fit, apply in zip(query_halves(ds, seed), reversed(query_halves(ds, seed))):
        part = fit_isotonic(e[fit].tolist(), y[fit].tolist())
        crossed[apply] = apply_isotonic(part, e[apply])
    return {
        "pairs": len(ds),
        "rmse_linear": round(rmse(1 + (e - 1) / span), 4),
        "rmse_isotonic": round(rmse(apply_isotonic(knots, e)), 4),
        "rmse_isotonic_crossfit": round(rmse(crossed), 4),
        "knots": len(knots[0]),
    }


def class_logits(model: RelevanceModel, pairs: Sequence[tuple[str, str]]) -> Tensor:
    """(n, classes) logits of (query, title) pairs, one per class of the head (before extra classes are
    merged): what calibration fits."""
    return model.encoded_logits(model.encode(pairs), raw=True)


def pairs_of(examples: Sequence[Example]) -> list[tuple[str, str]]:
    return [(e.query, e.title) for e in examples]


def calibrated(model: RelevanceModel, logits: Tensor, t: float, b: Tensor) -> Tensor:
    """Per-level logits after the calibration (temperature t, bias per class b) of per-class logits."""
    return merge_classes(logits / t + b, model.class_levels)


def set_level_rule(module: BertForRelevance, rule: LevelRule) -> None:
    module.cfg = replace(module.cfg, extra={**module.cfg.extra, **rule.to_extra()})


def crossfit_qwk(
    ds: Dataset, expected: Tensor, k: int, min_share: float, seed: int = 0, fixed: dict[int, float] | None = None
) -> float:
    """QWK of cut points fitted on one half of the queries and applied to the other, both ways: an
    estimate of the level rule's kappa on unseen queries (fitting and scoring on the same pairs flatters it)."""
    a, b = query_halves(ds, seed)
    y = ds.labels
    pred = [0] * len(ds)
    for fit, apply in ((a, b), (b, a)):
        cuts = fit_cuts([float(expected[i]) for i in fit], [y[i] for i in fit], k, min_share, fixed=fixed)
        lv = LevelRule(cuts).levels(torch.empty(0), expected[apply])
        for i, v in zip(apply, lv.tolist()):
            pred[i] = v
    return quadratic_kappa(y, pred, k)


def calibrate(
    model_dir: str | Path,
    data_file: str | Path,
    out: str | Path,
    cuts: bool = True,
    min_share: float = 0.02,
    bias: bool = False,
    unrelated: float | None = None,
    negatives_weight: float = 1.0,
    levels: Sequence[str] | None = None,
) -> dict:
    """Fit the temperature (with `bias`, also a bias per level: vector scaling) and, with `cuts`, the
    level rule on `data_file`; write the checkpoint to `out`.

    With `unrelated` (a share, e.g. 0.95), the first cut point is not fitted for kappa but set so that
    that share of unrelated titles falls at the lowest level: sampled negatives of `data_file` (a quarter
    as many as its pairs, titles of the file never judged for the query) are scored, and the cut is their
    `unrelated` quantile. Judged candidates are mostly related, so kappa alone puts the cut low and an
    unrelated title lands at level 2; the other cut points are then fitted around it.

    A head with a "not a candidate" class (model.config) is calibrated per class, on the judged pairs and
    the sampled negatives (labelled with that class, each weighing `negatives_weight` of a judged pair):
    the judged pairs alone never show it, and would fit it away.

    A one-logit head (or `levels` given) gets its levels and their cut points instead (model.train.calibrate_logit)."""
    if levels is not None or load_config(Path(model_dir)).num_labels == 1:  # a one-logit head: its own fit
        from model.train.calibrate_logit import calibrate_logit_head

        if not cuts or bias or unrelated is not None:
            raise ValueError("a one-logit head is calibrated by its levels' cut points only (--levels, --min-share)")
        return calibrate_logit_head(model_dir, data_file, out, levels, min_share)
    if unrelated is not None and not (0 < unrelated < 1 and cuts):
        raise ValueError("--unrelated is a share in (0, 1) of the lowest level's cut point: it needs the cut points")
    module = load_module(model_dir)
    # float32 on cpu, not packed: the model scores with `module` itself, which is then folded and saved
    model = RelevanceModel(module, PairTokenizer.from_dir(model_dir), onednn=False, unpadded=False)
    ds = read_labelled(data_file, model.labels)
    neg_class = module.cfg.negative_class
    raw = class_logits(model, pairs_of(ds.examples))
    negatives = sample_negatives(ds, 0.25, seed=0, label=neg_class) if unrelated is not None or neg_class else []
    if (unrelated is not None or neg_class) and not negatives:
        raise ValueError(f"{data_file} has too few pairs to sample unrelated titles from")
    neg_raw = class_logits(model, pairs_of(negatives)) if negatives else None
    y = torch.tensor(ds.labels)
    fit_x, fit_y, fit_w = raw, y, None
    if neg_class and neg_raw is not None:
        fit_x = torch.cat([raw, neg_raw])
        fit_y = torch.cat([y, torch.full((len(negatives),), neg_class)])
        fit_w = torch.cat([torch.ones(len(y)), torch.full((len(negatives),), negatives_weight)])
    if bias:
        t, b = fit_vector_scaling(fit_x, fit_y, fit_w)
    else:
        t, b = fit_temperature(fit_x, fit_y), torch.zeros(fit_x.shape[1])
    before = torch.nn.functional.cross_entropy(fit_x, fit_y).item()
    after = torch.nn.functional.cross_entropy(fit_x / t + b, fit_y).item()
    logits = calibrated(model, raw, t, b)
    neg_logits = None if neg_raw is None else calibrated(model, neg_raw, t, b)
    fold_temperature(module, t)  # head / T, then + b: the same logits as above
    if bias:
        fold_bias(module, b)
    report = {
        "temperature": round(t, 4),
        "log_loss_before": round(before, 4),
        "log_loss_after": round(after, 4),
        "pairs": len(ds),
        "negatives_in_fit": len(fit_y) - len(ds),
        "out": str(out),
    }
    if bias:
        report["level_bias"] = [round(x, 4) for x in b.tolist()]
    if cuts:
        k = len(model.labels)
        plain = score_logits(logits, model.values, LevelRule())  # argmax levels and the expected level
        expected = plain.expected
        fixed = None
        if neg_logits is not None and unrelated is not None:
            neg = score_logits(neg_logits, model.values, LevelRule()).expected
            fixed = {0: float(torch.quantile(neg.double(), unrelated))}
        rule = LevelRule(fit_cuts(expected.tolist(), ds.labels, k, min_share, fixed=fixed))
        set_level_rule(module, rule)
        argmax = plain.level.tolist()
        report.update(
            {
                "level_cuts": list(rule.to_extra().values())[0],
                "qwk_argmax": round(quadratic_kappa(ds.labels, argmax, k), 4),
                "qwk_cuts": round(quadratic_kappa(ds.labels, rule.levels(torch.empty(0), expected).tolist(), k), 4),
                "qwk_cuts_crossfit": round(crossfit_qwk(ds, expected, k, min_share, fixed=fixed), 4),
            }
        )
        if fixed is not None:
            graded = rule.levels(torch.empty(0), expected)
            report["unrelated"] = {
                "negatives": len(negatives),
                "negatives_at_level_1": round(float((rule.levels(torch.empty(0), neg) == 0).double().mean()), 4),
                "judged_at_level_1": round(float((graded == 0).double().mean()), 4),
            }
    save_checkpoint(module, model.tokenizer, out)
    return report
