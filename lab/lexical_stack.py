"""Does the lexical baseline add what the cross-encoder misses? A stacking probe for issue 23's RMSE goal.

The lexical baseline (model.train.baseline: BM25, overlaps, numbers, brand; gradient-boosted trees fitted on
train.csv) and a checkpoint's five logits are stacked by a ridge regression onto the raters' relevance,
cross-fitted on dev by query (5 folds: every dev pair is predicted by a stacker that never saw its query).
Per stack: RMSE on the 1..3 scale, QWK with cut points fitted on the other folds, NDCG@10, and how sampled
negatives (random dev titles for dev queries, 0.25 per pair) and the hand-written off-domain titles fare
(AUC judged > random, their mean predicted relevance). Nothing here ships: it measures whether the lever
is worth building.

    python lab/lexical_stack.py model/default [more checkpoints]
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.impute import SimpleImputer
from sklearn.linear_model import Ridge
from sklearn.model_selection import GroupKFold
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration_variants import DEV, off_domain_pairs  # noqa: E402  (the bench folder is on the path)

from model.data import read_labelled  # noqa: E402
from model.relevance import RelevanceModel  # noqa: E402
from model.scoring import fit_cuts  # noqa: E402
from model.train.baseline import LexicalBaseline  # noqa: E402
from model.train.calibrate import class_logits, pairs_of  # noqa: E402
from model.train.metrics import mean_ndcg, quadratic_kappa  # noqa: E402
from model.train.negatives import sample_negatives  # noqa: E402

LABELS = ["1", "2", "3", "4", "5"]


def main() -> int:
    torch.set_num_threads(1)
    dev = read_labelled(DEV, LABELS)
    train = read_labelled(DEV.with_name("train.csv"), LABELS)
    pairs = pairs_of(dev.examples)
    y = np.array([e.relevance for e in dev.examples])
    lab = [e.label for e in dev.examples]
    qs = [e.query for e in dev.examples]
    groups = [q.lower() for q in qs]
    neg = pairs_of(sample_negatives(dev, 0.25, seed=1))  # as qtrel eval --negatives 0.25
    off = off_domain_pairs()
    lex = LexicalBaseline(LABELS).fit(train)
    F, Fn, Fo = lex.features(pairs), lex.features(neg), lex.features(off)
    P, Pn, Po = lex.predict_proba(pairs), lex.predict_proba(neg), lex.predict_proba(off)
    for ck in sys.argv[1:]:
        m = RelevanceModel.load(ck, dtype="float32")
        L, Ln, Lo = (class_logits(m, p).float().numpy() for p in (pairs, neg, off))
        for name, (X, Xn, Xo) in {
            "logits": (L, Ln, Lo),
            "logits+lexical": (np.c_[L, F], np.c_[Ln, Fn], np.c_[Lo, Fo]),
            "logits+lexical+lexical GBM probabilities": (np.c_[L, F, P], np.c_[Ln, Fn, Pn], np.c_[Lo, Fo, Po]),
        }.items():
            pred = np.zeros(len(y))
            pn = np.zeros(len(neg))
            po = np.zeros(len(off))
            lv = np.zeros(len(y), int)
            for tr, te in GroupKFold(5).split(X, y, groups):
                r = make_pipeline(SimpleImputer(), StandardScaler(), Ridge(10.0)).fit(X[tr], y[tr])
                pred[te] = r.predict(X[te])
                pn += r.predict(Xn) / 5
                po += r.predict(Xo) / 5
                etr = 1 + 2 * (r.predict(X[tr]) - 1)
                cuts = fit_cuts(etr.tolist(), [lab[i] for i in tr], 5)
                lv[te] = np.searchsorted(np.array(cuts), 1 + 2 * (pred[te] - 1), side="right")
            rmse = np.sqrt(((pred - y) ** 2).mean())
            auc = (pred[:, None] > pn[None, :]).mean()
            qwk, ndcg = quadratic_kappa(lab, lv.tolist(), 5), mean_ndcg(qs, lab, pred.tolist())
            print(
                f"{ck} {name}: rmse {rmse:.4f} qwk {qwk:.4f} ndcg {ndcg:.4f} auc judged>random {auc:.4f} "
                f"neg mean rel {pn.mean():.3f} off mean rel {po.mean():.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
