"""Does the head decide the RMSE? Heads of different kinds on one frozen encoder (issue 23).

The issue's first idea is an ordinal head (cumulative link, CORAL-style thresholds on one latent score)
instead of the five-way classifier. Before retraining a whole model for it, this asks the cheap question:
on the features the shipped classifier reads (the [CLS] row after the pooler, 384 numbers), does a head of
another kind, fitted on the same training pairs, give a better score? Heads, each fitted on train.csv's
judged pairs (no negatives) and scored on dev's:

  shipped        the checkpoint's own classifier (as calibrated and shipped)
  softmax        a five-way logistic regression refitted on the frozen features
  cumulative     one latent score s = w·x and four thresholds: P(level ≤ k) = σ(θ_k − s) (ordinal logit)
  regression     least squares on the raters' relevance (1..3), the score itself

Every head's score is mapped to the 1..3 scale (expected level: 1 + (E − 1) / 2) and its RMSE against the
raters reported as is and after a monotone map fitted on one half of dev's queries and applied to the other
(`isotonic`), which removes any miscalibration and leaves what the ranking of pairs allows. A final row fits
the cumulative head on dev itself, cross-fitted by query halves (3,600 pairs for 384 weights: it overfits,
so the train fits are the fair ones).

    cd bench && python frozen_heads.py ../model/default [--threads 1] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration_variants import DEV  # noqa: E402

from model.data import read_labelled  # noqa: E402
from model.levels import MAX_BATCH_TOKENS  # noqa: E402
from model.packing import pack  # noqa: E402
from model.relevance import RelevanceModel, length_batches  # noqa: E402
from model.train.calibrate import isotonic_rmse, pairs_of, query_halves  # noqa: E402

TRAIN = DEV.parent / "train.csv"
LEVELS = ["1", "2", "3", "4", "5"]


def features(m: RelevanceModel, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, hidden) classifier inputs and (n, 5) logits of the shipped head, both in input order (the packed
    forward works in length order and only its logits are put back, so the features are put back here)."""
    enc, bert, head = m.encode(pairs), m.module.bert, m.module.classifier
    feats, logits = torch.empty(len(enc), m.module.cfg.hidden_size), torch.empty(len(enc), 5)
    w = bert.embeddings.word.weight
    with torch.inference_mode():
        for n, batch in enumerate(length_batches(enc.lengths, MAX_BATCH_TOKENS)):
            ids, tts = [enc.input_ids[i] for i in batch], [enc.token_type_ids[i] for i in batch]
            p = pack(ids, tts, w.device, w.dtype)
            pooled = bert.forward_packed(p).float()
            x = torch.empty_like(pooled).index_copy_(0, p.order, pooled)
            feats[batch] = x
            logits[batch] = head(x.to(w.dtype)).float()
            if n == 0:  # against the model's own answer, once: same order, same numbers
                torch.testing.assert_close(logits[batch], m.logits(ids, tts), rtol=0.02, atol=0.02)
    return feats, logits


def fit(params: list[torch.Tensor], loss_fn, iters: int = 300) -> None:
    opt = torch.optim.LBFGS(params, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    opt.step(closure)


def softmax_head(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-4):
    w = torch.zeros(x.shape[1], 5, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    fit([w, b], lambda: F.cross_entropy(x @ w + b, y) + l2 * w.pow(2).sum())
    return lambda z: ((z @ w + b).softmax(-1) @ torch.arange(1.0, 6.0, dtype=torch.float64)).detach()


def cumulative_head(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-4):
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    t0 = torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=torch.float64)
    base = t0[:1].clone().requires_grad_(True)
    gaps = torch.log(t0.diff()).clone().requires_grad_(True)  # thresholds increase by construction

    def probs(z: torch.Tensor) -> torch.Tensor:
        th = torch.cat([base, base + torch.cumsum(gaps.exp(), 0)])
        cdf = torch.sigmoid(th[None, :] - (z @ w)[:, None])  # P(level <= k), k = 1..4
        cdf = torch.cat([torch.zeros(len(z), 1, dtype=z.dtype), cdf, torch.ones(len(z), 1, dtype=z.dtype)], 1)
        return cdf.diff(dim=1).clamp_min(1e-12)

    fit([w, base, gaps], lambda: F.nll_loss(probs(x).log(), y) + l2 * w.pow(2).sum())
    return lambda z: (probs(z) @ torch.arange(1.0, 6.0, dtype=torch.float64)).detach()


def regression_head(x: torch.Tensor, rel: torch.Tensor, l2: float = 1e-3):
    xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    w = torch.linalg.solve(xa.T @ xa + l2 * len(x) * torch.eye(xa.shape[1], dtype=x.dtype), xa.T @ rel)
    return lambda z: 1 + 2 * (torch.cat([z, torch.ones(len(z), 1, dtype=z.dtype)], 1) @ w - 1)  # as a level 1..5


def report(name: str, ds, expected: torch.Tensor) -> dict:
    rel = torch.tensor([e.relevance for e in ds.examples], dtype=torch.float64)
    on_scale = 1 + (expected.double() - 1) / 2
    iso = isotonic_rmse(ds, expected.double(), 5)
    row = {
        "head": name,
        "rmse": round(float((on_scale - rel).pow(2).mean().sqrt()), 4),
        "rmse_isotonic_crossfit": iso["rmse_isotonic_crossfit"],
    }
    print(f"{name:44s} RMSE {row['rmse']:.4f}, after a monotone map (cross-fitted) {row['rmse_isotonic_crossfit']:.4f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.model)
    train, dev = read_labelled(TRAIN, LEVELS), read_labelled(DEV, LEVELS)
    t0 = time.perf_counter()
    xt, _ = features(m, pairs_of(train.examples))
    xd, shipped = features(m, pairs_of(dev.examples))
    print(f"features of {len(train)} + {len(dev)} pairs in {time.perf_counter() - t0:.0f} s", flush=True)
    mu, sd = xt.mean(0), xt.std(0).clamp_min(1e-6)
    xt, xd = (((x - mu) / sd).double() for x in (xt, xd))
    yt = torch.tensor(train.labels)
    rt = torch.tensor([e.relevance for e in train.examples], dtype=torch.float64)
    values = torch.arange(1.0, 6.0, dtype=torch.float64)
    rows = [report("shipped head (calibrated)", dev, shipped.double().softmax(-1) @ values)]
    rows.append(report("softmax head refitted on train (judged only)", dev, softmax_head(xt, yt)(xd)))
    rows.append(report("cumulative-link head on train (ordinal)", dev, cumulative_head(xt, yt)(xd)))
    rows.append(report("regression on relevance, train", dev, regression_head(xt, rt)(xd)))
    yd = torch.tensor(dev.labels)
    crossed = torch.empty(len(dev), dtype=torch.float64)
    halves = query_halves(dev)
    for fit_idx, apply in zip(halves, reversed(halves)):
        crossed[apply] = cumulative_head(xd[fit_idx], yd[fit_idx])(xd[apply])
    rows.append(report("cumulative-link head on dev, cross-fitted", dev, crossed))
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
