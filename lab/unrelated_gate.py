"""A gate for unrelated titles (issue 23): is the pair a candidate at all, and if not, level 1 with confidence.

The judged-pair calibration that keeps the score honest (RMSE) also keeps p(level 1) of plainly unrelated
titles near 0.45: judged pairs never show such titles, so nothing tells the calibration how sure to be of
them. Here a second, tiny model does: a logistic regression on the calibrated head's log-probabilities
(6 numbers) that tells sampled random titles (label 1) from judged candidates (label 0). The grade mixes
the two: p = (1 - g) * p_calibrated + g * [1, 0, 0, 0, 0], the score is p's expected level as always, and
the level rule's cut points are fitted afresh (the first pinned at a share of sampled negatives, as shipped).

Judged pairs get the gate cross-fitted (fitted on one half of the queries, applied to the other), so their
RMSE and QWK are honest; the test negatives (another seed) and the hand-written off-domain titles are never
fitted on. `weight` scales the negatives in the gate's fit (the prior of an unrelated title). A fitted gate
is soft: it moves many judged pairs a little. `--quantiles` re-centres it so that g = 1/2 falls at that
quantile of the judged pairs' gate logits, and `--sharpness` multiplies the logit: a steep gate that leaves
all but the most unrelated-looking judged pairs alone. With `--overlap`, the gate also reads the share of
the query's word pieces found in the title (and whether it is zero), from the tokens the model reads.

    python lab/unrelated_gate.py model/default runs/v3t/step-6000 [--out docs/bench/unrelated_gate.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration_variants import DEV, off_domain_pairs  # noqa: E402  (the bench folder is on the path)

from model.data import read_labelled  # noqa: E402
from model.relevance import RelevanceModel  # noqa: E402
from model.scoring import LevelRule, ScoredBatch, fit_cuts  # noqa: E402
from model.train.calibrate import (  # noqa: E402
    calibrated,
    class_logits,
    crossfit_qwk,
    fit_vector_scaling,
    pairs_of,
    query_halves,
)
from model.train.evaluate import metrics_of, negatives_report  # noqa: E402
from model.train.negatives import sample_negatives  # noqa: E402

SHARE = 0.95  # sampled negatives at level 1, as the shipped rule


def fit_gate(pos: torch.Tensor, neg: torch.Tensor, weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression (w, c) on log-probabilities: negatives 1, judged 0, negatives weighted."""
    x = torch.cat([pos, neg]).double()
    y = torch.cat([torch.zeros(len(pos)), torch.ones(len(neg))]).double()
    sw = torch.cat([torch.ones(len(pos)), torch.full((len(neg),), weight)]).double()
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    c = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, c], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        z = x @ w + c
        loss = (sw * torch.nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none")).sum() / sw.sum()
        loss = loss + 1e-4 * w.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return w.detach(), c.detach()


def gated(logp: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """Probabilities after a gate g (B,) (none: the calibrated ones)."""
    p = logp.exp().double()
    if g is None:
        return p
    one = torch.zeros_like(p)
    one[:, 0] = 1.0
    return (1 - g[:, None]) * p + g[:, None] * one


def overlap(m: RelevanceModel, pairs) -> torch.Tensor:
    """(B, 2): the share of the query's distinct word pieces found in the title, and whether it is zero."""
    enc, special = m.encode(pairs), {m.tokenizer.cls_id, m.tokenizer.sep_id}
    rows = []
    for ids, seg in zip(enc.input_ids, enc.token_type_ids, strict=True):
        q = {i for i, s in zip(ids, seg, strict=True) if s == 0 and i not in special}
        t = {i for i, s in zip(ids, seg, strict=True) if s == 1 and i not in special}
        share = len(q & t) / max(len(q), 1)
        rows.append([share, float(share == 0)])
    return torch.tensor(rows, dtype=torch.float64)


def gate_fn(fit_neg: torch.Tensor, weight: float, sharp: float, quantile: float | None):
    """judged features to fit on, features to gate -> g: the gate fitted on those judged pairs."""

    def fn(judged: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        w, c = fit_gate(judged, fit_neg, weight)
        shift = 0.0 if quantile is None else -float(torch.quantile(judged.double() @ w + c, quantile))
        return torch.sigmoid(sharp * (x.double() @ w + c + shift))

    return fn


def scored(p: torch.Tensor, values: torch.Tensor, rule: LevelRule) -> ScoredBatch:
    p = p.float()
    e = p @ values.float()
    return ScoredBatch(p.log(), p, e, rule.levels(p, e))


def sweep(path: str, ds, fit_negs, test_negs, off_pairs, a) -> list[dict]:
    m = RelevanceModel.load(path)
    y = torch.tensor(ds.labels)
    pairs = {"judged": pairs_of(ds.examples), "fit": pairs_of(fit_negs), "test": pairs_of(test_negs), "off": off_pairs}
    raw = {k: class_logits(m, v) for k, v in pairs.items()}
    t, b = fit_vector_scaling(raw["judged"], y)  # as v3 was calibrated (model/default: folded already, ~identity)
    logp = {k: calibrated(m, v, t, b).log_softmax(-1) for k, v in raw.items()}
    feats = {"logits": {k: v.double() for k, v in logp.items()}}
    if a.overlap:
        feats["logits + overlap"] = {k: torch.cat([v.double(), overlap(m, pairs[k])], 1) for k, v in logp.items()}
    halves = query_halves(ds)
    variants = [("none", None, None, 1.0, None)] + [
        (name, f, w, s, q)
        for name, f in feats.items()
        for w in a.weights
        for s in a.sharpness
        for q in [None, *a.quantiles]
    ]
    rows = []
    for name, f, weight, sharp, q in variants:
        if f is None:
            p = {k: gated(v, None) for k, v in logp.items()}
        else:
            fn = gate_fn(f["fit"], weight, sharp, q)
            p = {k: gated(logp[k], fn(f["judged"], f[k])) for k in ("fit", "test", "off")}
            pj = torch.empty_like(logp["judged"], dtype=torch.float64)
            for fit, apply in zip(halves, reversed(halves)):
                pj[apply] = gated(logp["judged"][apply], fn(f["judged"][fit], f["judged"][apply]))
            p["judged"] = pj
        e = {k: (v.float() @ m.values.float()) for k, v in p.items()}
        fixed = {0: float(torch.quantile(e["fit"].double(), SHARE))}
        rule = LevelRule(fit_cuts(e["judged"].tolist(), ds.labels, len(m.labels), 0.02, fixed=fixed))
        sj, sn, so = (scored(p[k], m.values, rule) for k in ("judged", "test", "off"))
        mm, negs = metrics_of(ds, sj), negatives_report(ds, sj, test_negs, sn)
        row = {
            "checkpoint": path,
            "gate": name,
            "weight": weight,
            "sharpness": sharp,
            "judged_quantile": q,
            "cuts": [round(c, 4) for c in rule.cuts],
            "rmse_relevance": mm["rmse_relevance"],
            "qwk": mm["qwk"],
            "qwk_crossfit": crossfit_qwk(ds, sj.expected, len(m.labels), 0.02, fixed=fixed),
            "ndcg@10": mm["ndcg@10"],
            "negatives_level1": negs["level1_share"],
            "negatives_level12": negs["level12_share"],
            "auc": negs["auc"],
            "off_domain_level1": int((so.level == 0).sum()),
            "off_domain_level12": int((so.level <= 1).sum()),
            "off_domain_p1": so.probs[:, 0].mean().item(),
            "level_shares": (torch.bincount(sj.level, minlength=len(m.labels)) / len(sj.level)).tolist(),
        }
        rows.append(row)
        print(
            f"{path} {name} w={weight} sharp={sharp} q={q}: rmse {row['rmse_relevance']:.4f} "
            f"qwk {row['qwk']:.4f} ({row['qwk_crossfit']:.4f}) ndcg {row['ndcg@10']:.4f} "
            f"neg1 {row['negatives_level1']:.3f} neg12 {row['negatives_level12']:.3f} auc {row['auc']:.4f} "
            f"off1 {row['off_domain_level1']} off12 {row['off_domain_level12']} p1 {row['off_domain_p1']:.2f} "
            f"shares {' '.join(f'{s:.3f}' for s in row['level_shares'])}",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--data", default=str(DEV))
    ap.add_argument("--weights", type=float, nargs="+", default=[0.25])
    ap.add_argument("--sharpness", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--quantiles", type=float, nargs="+", default=[0.99, 0.995, 0.999])
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ds = read_labelled(a.data, ["1", "2", "3", "4", "5"])
    fit_negs, test_negs = sample_negatives(ds, 0.25, seed=0), sample_negatives(ds, 0.25, seed=1)
    off = off_domain_pairs()
    rows = [r for c in a.checkpoints for r in sweep(c, ds, fit_negs, test_negs, off, a)]
    if a.out:
        Path(a.out).write_text(json.dumps({"data": a.data, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
