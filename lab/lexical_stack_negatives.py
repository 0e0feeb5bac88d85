"""Issue 23: can a lexical stack meet RMSE <= 0.465 and QWK >= 0.47 without grading unrelated titles higher?

Reads the cache of lab/lexical_stack_cache.py (/tmp/lexstack: model/default's logits, the lexical baseline's
23 features and its trees' 5 probabilities on dev, sampled negatives and the off-domain titles). Every stack
is cross-fitted on dev by query, 5 folds (GroupKFold on the lower-cased query, as lab/lexical_stack.py):
each dev pair, and each sampled negative of its query, is scored by a stacker and cut points that never saw
that query. Negatives used in a fit ("neg_fit": 1.0 per judged pair, seed 11; "foreign_fit": 0.25, seed 12)
are other draws than the evaluated ones ("neg_eval" = qtrel eval --negatives 0.25, seed 0; "foreign_eval":
0.25, seed 13), and a fold's fit only holds negatives of its own training queries. Off-domain titles (100)
are scored by the stack and cut points fitted on all of dev (what would ship).

Columns: RMSE on 1..3; QWK of levels from cut points fitted (fit_cuts, every level >= 2% of dev) on the
other folds; NDCG@10; AUC judged vs random title of the same query (as qtrel eval's negatives_report);
random titles at level 1 and 1-2; foreign titles at level 1 and 1-2; off-domain at level 1 and 1-2 and
mean relevance; the smallest level share of dev (cross-fitted levels).

    OMP_NUM_THREADS=1 python lab/lexical_stack_negatives.py [--only PATTERN] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402
from sklearn.impute import SimpleImputer  # noqa: E402
from sklearn.linear_model import Ridge  # noqa: E402
from sklearn.model_selection import GroupKFold  # noqa: E402
from sklearn.pipeline import make_pipeline  # noqa: E402
from sklearn.preprocessing import StandardScaler  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_variants import DEV  # noqa: E402

from model.data import read_labelled  # noqa: E402
from model.scoring import fit_cuts  # noqa: E402
from model.train.baseline import FEATURES  # noqa: E402
from model.train.evaluate import same_query_auc  # noqa: E402
from model.train.metrics import mean_ndcg, quadratic_kappa  # noqa: E402

CACHE = Path("/tmp/lexstack")
LABELS = ["1", "2", "3", "4", "5"]
SHIPPED_CUTS = (2.986621, 3.295687, 3.772028, 4.078058)  # model/default/config.json qtrel_level_cuts
MIN_SHARE = 0.02
SETS = ("dev", "neg_eval", "neg_fit", "foreign_fit", "foreign_eval", "off")
PLAIN = ["q_numbers", "number_match", "number_miss", "brand_match", "bm25", "bm25_norm"]


def load():
    D = {}
    for s in SETS:
        D[s] = {
            "L": np.load(CACHE / f"{s}_L.npy").astype(np.float64),
            "F": np.load(CACHE / f"{s}_F.npy"),
            "P": np.load(CACHE / f"{s}_P.npy"),
            "pairs": json.loads((CACHE / f"{s}_pairs.json").read_text()),
        }
        L = D[s]["L"]
        p = np.exp(L - L.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        D[s]["p"] = p
        D[s]["E"] = p @ np.arange(1, 6)
        D[s]["rel"] = 1 + (D[s]["E"] - 1) / 2  # the shipped model's relevance on 1..3
    return D


def block(d, name: str) -> np.ndarray:
    if name == "L":
        return d["L"]
    if name == "P":
        return d["P"]
    if name == "F":
        return d["F"]
    if name == "plain":
        return d["F"][:, [FEATURES.index(f) for f in PLAIN]]
    if name.startswith("F-"):  # F without one feature
        return np.delete(d["F"], FEATURES.index(name[2:]), axis=1)
    if name.startswith("f:"):  # single named features, comma separated
        return d["F"][:, [FEATURES.index(f) for f in name[2:].split(",")]]
    raise KeyError(name)


def design(d, blocks) -> np.ndarray:
    return np.concatenate([block(d, b) for b in blocks], axis=1)


def make_stacker(kind: str, alpha: float):
    if kind == "ridge":
        return make_pipeline(SimpleImputer(), StandardScaler(), Ridge(alpha))
    if kind == "gbm":
        from sklearn.ensemble import HistGradientBoostingRegressor

        return HistGradientBoostingRegressor(
            max_iter=300,
            learning_rate=0.05,
            max_leaf_nodes=15,
            min_samples_leaf=40,
            l2_regularization=1.0,
            early_stopping=False,
            random_state=0,
        )
    raise KeyError(kind)


def fit_predict(spec, D, tr_dev, tr_neg, tr_for, targets):
    """Fit one stacker on dev rows tr_dev (+ negatives of the fit sets, target 1.0, weighted) and return a
    function set_name -> prediction on the relevance scale (before gating)."""
    blocks, kind = spec["blocks"], spec.get("kind", "ridge")
    wr, wf = spec.get("w_neg", 0.0), spec.get("w_foreign", 0.0)
    residual = spec.get("residual")
    Xs = [design(D["dev"], blocks)[tr_dev]]
    ys = [D["dev"]["y"][tr_dev]]
    ws = [np.ones(len(tr_dev))]
    base = [D["dev"]["rel"][tr_dev]]
    for name, idx, w in (("neg_fit", tr_neg, wr), ("foreign_fit", tr_for, wf)):
        if w > 0 and len(idx):
            Xs.append(design(D[name], blocks)[idx])
            ys.append(np.ones(len(idx)))
            ws.append(np.full(len(idx), w))
            base.append(D[name]["rel"][idx])
    X, y, w, b = np.concatenate(Xs), np.concatenate(ys), np.concatenate(ws), np.concatenate(base)
    if spec.get("fit_gated") and spec.get("gate"):  # fit only where the stack will be used
        pm = np.concatenate(
            [D["dev"]["p"][tr_dev]]
            + [
                D[nm]["p"][ix]
                for nm, ix, ww in (("neg_fit", tr_neg, wr), ("foreign_fit", tr_for, wf))
                if ww > 0 and len(ix)
            ]
        )
        use = gate(spec, np.zeros(len(b)), b, pm) == 0  # rows the gate hands to the stack
        X, y, w, b = X[use], y[use], w[use], b[use]
    r = make_stacker(kind, spec.get("alpha", 10.0))
    target = y - b if residual is not None else y
    if kind == "ridge":
        r.fit(X, target, ridge__sample_weight=w)
    else:
        r.fit(X, target, sample_weight=w)

    def predict(name, idx=None):
        d = D[name]
        Xp = design(d, blocks) if idx is None else design(d, blocks)[idx]
        rel = d["rel"] if idx is None else d["rel"][idx]
        pr = r.predict(Xp)
        pmod = d["p"] if idx is None else d["p"][idx]
        if residual is not None:
            lo, hi = (residual, residual) if np.isscalar(residual) else residual
            corr = np.clip(pr, -lo, hi)
            if spec.get("soft"):  # upward corrections shrink as the model's p(level 1) grows
                corr = np.where(corr > 0, corr * np.clip(1 - pmod[:, 0] / spec["soft"], 0, 1), corr)
            pr = rel + corr
        return gate(spec, pr, rel, pmod)

    return predict


def gate(spec, stack, rel, p):
    """Keep the model's own relevance where it says the pair is unrelated."""
    g = spec.get("gate")
    if g is None:
        return stack
    kind, v = g
    if spec.get("floor_gate"):  # pairs handed to the stack never fall below the gate either
        stack = np.maximum(stack, v)
    if kind == "p1":  # model's p(level 1) >= v
        keep = p[:, 0] >= v
    elif kind == "rel":  # model's relevance below v (1..3 scale)
        keep = rel < v
    elif kind == "min":  # never above the model where the model is below v
        return np.where(rel < v, np.minimum(stack, rel), stack)
    else:
        raise KeyError(kind)
    return np.where(keep, rel, stack)


def fit_level_cuts(spec, rel_dev, lab, rel_neg):
    """fit_cuts on the expected level (1..5), every level >= 2% of dev; with spec["pin"] (default 0.95) the
    first cut is pinned at that quantile of the fit negatives' scores, as qtrel calibrate --unrelated 0.95
    (there on the evaluated negatives themselves; here on other draws, of the fold's training queries)."""
    pin = spec.get("pin", 0.95)
    en = 1 + 2 * (np.asarray(rel_neg) - 1)
    fixed = None if pin is None else {0: float(np.quantile(en, pin))}
    if spec.get("fix1") is not None:  # keep the shipped model's first cut point as it is
        fixed = {0: spec["fix1"]}
    e, y = (1 + 2 * (np.asarray(rel_dev) - 1)).tolist(), np.asarray(lab).tolist()
    cuts = fit_cuts(e, y, 5, MIN_SHARE, fixed=fixed)
    floor2 = spec.get("pin2")  # the second cut at least at this quantile of the fit negatives (level 1-2 share)
    if floor2 is not None and cuts[1] < np.quantile(en, floor2):
        cuts = fit_cuts(e, y, 5, MIN_SHARE, fixed={**(fixed or {}), 1: float(np.quantile(en, floor2))})
    return cuts


def levels(rel, cuts):
    return np.searchsorted(np.asarray(cuts), 1 + 2 * (np.asarray(rel) - 1), side="right")


def evaluate(spec, D, folds, neg_folds) -> dict:
    dev = D["dev"]
    n = len(dev["y"])
    pred = np.zeros(n)
    lv = np.zeros(n, int)
    out_sets = {s: (np.zeros(len(D[s]["y_q"])), np.zeros(len(D[s]["y_q"]), int)) for s in ("neg_eval", "foreign_eval")}
    for k, (tr, te) in enumerate(folds):
        tr_neg = np.flatnonzero(neg_folds["neg_fit"] != k)
        tr_for = np.flatnonzero(neg_folds["foreign_fit"] != k)
        if spec.get("model_only"):

            def predict(name, idx=None):
                return D[name]["rel"] if idx is None else D[name]["rel"][idx]
        else:
            predict = fit_predict(spec, D, tr, tr_neg, tr_for, None)
        pred[te] = predict("dev", te)
        cuts = spec.get("cuts") or fit_level_cuts(spec, predict("dev", tr), dev["lab"][tr], predict("neg_fit", tr_neg))
        lv[te] = levels(pred[te], cuts)
        for s, (ps, ls) in out_sets.items():
            idx = np.flatnonzero(neg_folds[s] == k)
            ps[idx] = predict(s, idx)
            ls[idx] = levels(ps[idx], cuts)
    # the whole-dev fit, for off-domain titles (what would ship)
    all_dev = np.arange(n)
    if spec.get("model_only"):
        full = lambda name, idx=None: D[name]["rel"]  # noqa: E731
    else:
        full = fit_predict(
            spec, D, all_dev, np.arange(len(D["neg_fit"]["L"])), np.arange(len(D["foreign_fit"]["L"])), None
        )
    cuts_full = spec.get("cuts") or fit_level_cuts(spec, full("dev"), dev["lab"], full("neg_fit"))
    po = full("off")
    lo = levels(po, cuts_full)
    # as qtrel calibrate --unrelated 0.95 would ship it: the first cut at the 95% quantile of neg_eval itself
    cuts_ship = spec.get("cuts") or fit_level_cuts(spec, full("dev"), dev["lab"], full("neg_eval"))
    lo_ship = levels(po, cuts_ship)
    ln_ship = levels(full("neg_eval"), cuts_ship)
    pn, ln = out_sets["neg_eval"]
    pf, lf = out_sets["foreign_eval"]
    shares = np.bincount(lv, minlength=5) / n
    return {
        "rmse": float(np.sqrt(((pred - dev["y"]) ** 2).mean())),
        "qwk": float(quadratic_kappa(dev["lab"].tolist(), lv.tolist(), 5)),
        "ndcg": float(mean_ndcg(dev["q"], dev["lab"].tolist(), pred.tolist())),
        "auc": float(same_query_auc(dev["q"], pred.tolist(), D["neg_eval"]["y_q"], pn.tolist())),
        "rand_l1": float((ln == 0).mean()),
        "rand_l12": float((ln <= 1).mean()),
        "for_l1": float((lf == 0).mean()),
        "for_l12": float((lf <= 1).mean()),
        "auc_foreign": float(same_query_auc(dev["q"], pred.tolist(), D["foreign_eval"]["y_q"], pf.tolist())),
        "off_l1": int((lo == 0).sum()),
        "off_l12": int((lo <= 1).sum()),
        "off_mean_rel": float(po.mean()),
        "ship_off_l1": int((lo_ship == 0).sum()),
        "ship_off_l12": int((lo_ship <= 1).sum()),
        "ship_rand_l1": float((ln_ship == 0).mean()),
        "ship_rand_l12": float((ln_ship <= 1).mean()),
        "cuts_ship": [round(float(c), 4) for c in cuts_ship],
        "min_share": float(shares.min()),
        "shares": [round(float(x), 4) for x in shares],
        "cuts_full": [round(float(c), 4) for c in cuts_full],
    }


def variants():
    V = {}
    V["shipped model (its own dev cuts)"] = {"model_only": True, "cuts": SHIPPED_CUTS}
    V["shipped model (cuts x-fitted, level-1 pinned)"] = {"model_only": True}
    V["shipped model (cuts x-fitted, unpinned)"] = {"model_only": True, "pin": None}
    V["ridge L+F+P neg0.0 unpinned (lexical_stack.py)"] = {"blocks": ["L", "F", "P"], "pin": None}
    for blocks in (["L"], ["L", "F"], ["L", "P"], ["L", "F", "P"], ["L", "plain"], ["L", "plain", "P"]):
        for wr in (0.0, 0.1, 0.3, 1.0):
            V[f"ridge {'+'.join(blocks)} neg{wr}"] = {"blocks": blocks, "w_neg": wr}
    for wr, wf in ((0.3, 0.3), (0.3, 1.0), (1.0, 1.0), (1.0, 3.0)):
        V[f"ridge L+F+P neg{wr} foreign{wf}"] = {"blocks": ["L", "F", "P"], "w_neg": wr, "w_foreign": wf}
    for g in (("p1", 0.3), ("p1", 0.5), ("rel", 1.9), ("rel", 2.0), ("min", 2.0), ("min", 2.2)):
        for wr in (0.0, 0.3):
            V[f"ridge L+F+P neg{wr} gate {g[0]}{g[1]}"] = {"blocks": ["L", "F", "P"], "w_neg": wr, "gate": g}
    for d in (0.1, 0.2, 0.3):
        for wr in (0.0, 0.3):
            V[f"residual L+F+P clip{d} neg{wr}"] = {"blocks": ["L", "F", "P"], "w_neg": wr, "residual": d}
    for wr in (0.0, 0.3, 1.0):
        V[f"gbm L+F neg{wr}"] = {"blocks": ["L", "F"], "kind": "gbm", "w_neg": wr}
    return V


def variants2():
    """Round 2: the residual correction, gated and bounded, and which features carry it."""
    V = {}
    V["shipped model (cuts x-fitted, level-1 pinned)"] = {"model_only": True}
    R = {"blocks": ["L", "F", "P"], "residual": 0.1}
    for d in (0.1, 0.15, 0.2):
        for g in (("rel", 1.9), ("rel", 2.0), ("p1", 0.3), ("p1", 0.2)):
            V[f"residual L+F+P clip{d} gate {g[0]}{g[1]}"] = {**R, "residual": d, "gate": g}
            V[f"residual L+F+P clip{d} gate {g[0]}{g[1]} fit gated"] = {
                **R,
                "residual": d,
                "gate": g,
                "fit_gated": True,
            }
    for d in ((0.3, 0.1), (0.3, 0.05), (0.2, 0.1), (0.3, 0.0)):
        V[f"residual L+F+P clip-{d[0]}/+{d[1]}"] = {**R, "residual": d}
    for d in (0.1, 0.2, 0.3):
        for sft in (0.3, 0.5):
            V[f"residual L+F+P clip{d} soft p1/{sft}"] = {**R, "residual": d, "soft": sft}
    for blocks in (["L", "F"], ["L", "P"], ["L", "plain"], ["L", "plain", "P"], ["F", "P"], ["P"], ["F"], ["plain"]):
        V[f"residual {'+'.join(blocks)} clip0.15 gate rel2.0"] = {
            "blocks": blocks,
            "residual": 0.15,
            "gate": ("rel", 2.0),
        }
    return V


def variants3():
    """Round 3: round 2's best with the second cut floored at a quantile of the fit negatives."""
    V = {}
    V["shipped model (cuts x-fitted, level-1 pinned)"] = {"model_only": True}
    R = {"blocks": ["L", "F", "P"]}
    for q in (0.985, 0.99):
        V[f"shipped model pin2 {q}"] = {"model_only": True, "pin2": q}
        V[f"ridge L+F+P neg0.0 gate rel2.0 pin2 {q}"] = {**R, "gate": ("rel", 2.0), "pin2": q}
        for d in (0.1, 0.15, 0.2):
            V[f"residual L+F+P clip{d} gate rel2.0 pin2 {q}"] = {**R, "residual": d, "gate": ("rel", 2.0), "pin2": q}
            V[f"residual L+F+P clip{d} gate p10.2 pin2 {q}"] = {**R, "residual": d, "gate": ("p1", 0.2), "pin2": q}
            V[f"residual L+F+P clip{d} soft p1/0.3 pin2 {q}"] = {**R, "residual": d, "soft": 0.3, "pin2": q}
        V[f"residual L+F+P clip-0.2/+0.1 pin2 {q}"] = {**R, "residual": (0.2, 0.1), "pin2": q}
        for blocks in (["L", "P"], ["L", "plain", "P"], ["L", "F"], ["P"]):
            V[f"residual {'+'.join(blocks)} clip0.15 gate rel2.0 pin2 {q}"] = {
                "blocks": blocks,
                "residual": 0.15,
                "gate": ("rel", 2.0),
                "pin2": q,
            }
    return V


def variants4():
    """Round 4: the candidates, for fold-seed robustness and the ridge's alpha."""
    V = {"shipped model (cuts x-fitted, level-1 pinned)": {"model_only": True}}
    G = {"residual": 0.15, "gate": ("rel", 2.0), "pin2": 0.99}
    for alpha in (10.0, 100.0, 1000.0):
        V[f"residual L+P clip0.15 gate rel2.0 pin2 0.99 alpha{alpha:g}"] = {"blocks": ["L", "P"], **G, "alpha": alpha}
    V["residual L+F+P clip0.15 gate rel2.0 pin2 0.99"] = {"blocks": ["L", "F", "P"], **G}
    V["residual L+F+P clip0.1 gate rel2.0 pin2 0.99"] = {"blocks": ["L", "F", "P"], **G, "residual": 0.1}
    V["residual L+F+P clip0.1 soft p1/0.3 pin2 0.99"] = {
        "blocks": ["L", "F", "P"],
        "residual": 0.1,
        "soft": 0.3,
        "pin2": 0.99,
    }
    V["residual L+P clip0.1 soft p1/0.3 pin2 0.99"] = {"blocks": ["L", "P"], "residual": 0.1, "soft": 0.3, "pin2": 0.99}
    V["residual L+P clip0.2 gate rel2.0 pin2 0.99"] = {"blocks": ["L", "P"], **G, "residual": 0.2}
    V["ridge L+F+P neg0.0 unpinned (lexical_stack.py)"] = {"blocks": ["L", "F", "P"], "pin": None}
    return V


def variants5():
    """Round 5: the model's level 1 is final. Gate at the shipped first cut (E < 2.986621, i.e. relevance
    < 1.99331: the model's score is kept) and keep that cut; the stack's residual moves only pairs the model
    grades 2 or above; the second cut floored at a quantile of the fit negatives."""
    c1 = SHIPPED_CUTS[0]
    r1 = 1 + (c1 - 1) / 2
    V = {"shipped model (its own dev cuts)": {"model_only": True, "cuts": SHIPPED_CUTS}}
    V["shipped model, cut 1 kept, others x-fitted"] = {"model_only": True, "fix1": c1}
    for blocks in (["L", "P"], ["L", "F", "P"], ["L", "plain", "P"], ["L", "F"]):
        for d in (0.1, 0.15, 0.2):
            for q in (0.985, 0.99):
                V[f"residual {'+'.join(blocks)} clip{d} gate@cut1 pin2 {q}"] = {
                    "blocks": blocks,
                    "residual": d,
                    "gate": ("rel", r1),
                    "fix1": c1,
                    "pin2": q,
                }
    V["residual L+P clip0.15 soft p1/0.3 cut1 kept pin2 0.99"] = {
        "blocks": ["L", "P"],
        "residual": 0.15,
        "soft": 0.3,
        "fix1": c1,
        "pin2": 0.99,
    }
    V["ridge L+F+P gate@cut1 pin2 0.99 (full stack, not residual)"] = {
        "blocks": ["L", "F", "P"],
        "gate": ("rel", r1),
        "fix1": c1,
        "pin2": 0.99,
    }
    return V


def variants6():
    """Round 6: round 5's candidates (the model's level 1 kept), for fold-seed robustness."""
    c1 = SHIPPED_CUTS[0]
    r1 = 1 + (c1 - 1) / 2
    V = {"shipped model, cut 1 kept, others x-fitted": {"model_only": True, "fix1": c1}}
    for d in (0.15, 0.2):
        for q in (0.985, 0.99):
            base = {"blocks": ["L", "P"], "residual": d, "gate": ("rel", r1), "fix1": c1, "pin2": q}
            V[f"residual L+P clip{d} gate@cut1 pin2 {q}"] = base
            V[f"residual L+P clip{d} gate@cut1 floor pin2 {q}"] = {**base, "floor_gate": True}
    return V


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="regex on variant names")
    ap.add_argument("--json")
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--fold-seed", type=int, help="shuffle the query folds (robustness); default: GroupKFold's own")
    ap.add_argument("--extra", help="JSON dict of extra variants name -> spec")
    a = ap.parse_args()
    D = load()
    dev = read_labelled(DEV, LABELS)
    assert [(e.query, e.title) for e in dev.examples] == [tuple(p) for p in D["dev"]["pairs"]]
    D["dev"]["y"] = np.array([e.relevance for e in dev.examples])
    D["dev"]["lab"] = np.array([e.label for e in dev.examples])
    D["dev"]["q"] = [e.query for e in dev.examples]
    for s in SETS:
        D[s]["y_q"] = [q for q, _ in D[s]["pairs"]]
    groups = [q.lower() for q in D["dev"]["q"]]
    kf = GroupKFold(5) if a.fold_seed is None else GroupKFold(5, shuffle=True, random_state=a.fold_seed)
    folds = list(kf.split(np.zeros(len(groups)), groups=groups))
    fold_of = {}
    for k, (_, te) in enumerate(folds):
        for i in te:
            fold_of[groups[i]] = k
    neg_folds = {s: np.array([fold_of[q.lower()] for q in D[s]["y_q"]]) for s in SETS if s not in ("dev", "off")}
    V = {1: variants, 2: variants2, 3: variants3, 4: variants4, 5: variants5, 6: variants6}[a.round]()
    if a.extra:
        V.update(json.loads(a.extra))
    if a.only:
        V = {k: v for k, v in V.items() if re.search(a.only, k)}
    res = {}
    cols = [("rmse", 6), ("qwk", 6), ("ndcg", 6), ("auc", 6), ("rnd1", 5), ("rnd12", 5), ("for1", 5), ("for12", 5)]
    cols += [("aucF", 6), ("off1", 4), ("off12", 5), ("offrel", 6), ("minsh", 5)]
    hdr = f"{'variant':44s} " + " ".join(f"{c:>{w}s}" for c, w in cols)
    print(hdr, flush=True)
    for name, spec in V.items():
        r = evaluate(spec, D, folds, neg_folds)
        res[name] = {**r, "spec": {k: v for k, v in spec.items()}}
        print(
            f"{name:44s} {r['rmse']:.4f} {r['qwk']:.4f} {r['ndcg']:.4f} {r['auc']:.4f} {100 * r['rand_l1']:5.1f} "
            f"{100 * r['rand_l12']:5.1f} {100 * r['for_l1']:5.1f} {100 * r['for_l12']:5.1f} {r['auc_foreign']:.4f} "
            f"{r['off_l1']:4d} {r['off_l12']:5d} {r['off_mean_rel']:6.3f} {100 * r['min_share']:5.1f} | as shipped: "
            f"rnd {100 * r['ship_rand_l1']:.1f}/{100 * r['ship_rand_l12']:.1f} "
            f"off {r['ship_off_l1']}/{r['ship_off_l12']}",
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=list) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
