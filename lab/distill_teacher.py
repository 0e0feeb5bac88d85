"""Issue 23, "distil the stack into the encoder": the teacher, built on train.csv without leakage.

Steps (each cached under /tmp/distill-runs, one thread throughout):
  logits   model/default's per-class logits on train.csv (as lab/lexical_stack_cache.py does on dev)
  trees    out-of-fold level probabilities of the lexical baseline (model/train/baseline.py) on train.csv,
           5 folds split by query (GroupKFold on the lower-cased query); on dev, the mean of the 5 fold fits
  teacher  a stacker on [logits, OOF tree probabilities]: a ridge on the raters' relevance (1..3) and a
           multinomial logistic on the level, both cross-fitted by query on train (each train row is
           predicted by a stacker that never saw its query); fitted on all train and applied to dev to
           check that the teacher beats the model alone there; writes the `qtrel train --teacher` file.

  teacher-dev-half  the fallback (the train-fitted stacker loses to the model on dev): stackers fitted on one
           half of the dev queries, checked on the other half, applied to train (see teacher_dev_half)
  halves   calibrated students against model/default on each dev half (half B: never seen by that teacher)

    OMP_NUM_THREADS=1 nice -n 10 python lab/distill_teacher.py logits|trees|teacher|teacher-dev-half [--out FILE]
    OMP_NUM_THREADS=1 nice -n 10 python lab/distill_teacher.py halves CALIBRATED_CKPT... [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_variants import DEV  # noqa: E402

from model.data import read_labelled  # noqa: E402

TRAIN = DEV.with_name("train.csv")
LABELS = ["1", "2", "3", "4", "5"]
CACHE = Path("/tmp/distill-runs/teacher")
LEXSTACK = Path("/tmp/lexstack")  # lab/lexical_stack_cache.py model/default: dev logits


def logits(ck: str = "model/default") -> None:
    import torch

    from model.relevance import RelevanceModel
    from model.train.calibrate import class_logits, pairs_of

    torch.set_num_threads(1)
    m = RelevanceModel.load(ck, dtype="float32")
    for name, path in (("train", TRAIN), ("dev", DEV)):
        out = CACHE / f"{name}_L.npy"
        if out.exists():
            continue
        ds = read_labelled(path, LABELS)
        t0 = time.perf_counter()
        L = class_logits(m, pairs_of(ds.examples)).float().numpy()
        np.save(out, L)
        print(f"{name}: {len(L)} pairs, {time.perf_counter() - t0:.0f} s", flush=True)


def query_folds(ds, k: int = 5) -> np.ndarray:
    """Fold index per row, split by the lower-cased query (GroupKFold, as lab/lexical_stack.py)."""
    from sklearn.model_selection import GroupKFold

    groups = np.array([e.query.lower() for e in ds.examples])
    fold = np.empty(len(groups), dtype=int)
    for i, (_, te) in enumerate(GroupKFold(k).split(np.zeros(len(groups)), groups=groups)):
        fold[te] = i
    return fold


def trees() -> None:
    """Out-of-fold tree probabilities on train (each fold's baseline fitted on the other four folds; title
    statistics too) and, on dev, the mean of the five fold fits."""
    from model.data import Dataset
    from model.train.baseline import LexicalBaseline

    train, dev = read_labelled(TRAIN, LABELS), read_labelled(DEV, LABELS)
    fold = query_folds(train)
    oof, on_dev, meta = np.zeros((len(train), 5)), np.zeros((len(dev), 5)), []
    for k in range(5):
        t0 = time.perf_counter()
        part = Dataset([e for e, f in zip(train.examples, fold) if f != k], train.path)
        lex = LexicalBaseline(LABELS, threads=1).fit(part)
        te = np.flatnonzero(fold == k)
        oof[te] = lex.predict_proba([(train.examples[i].query, train.examples[i].title) for i in te])
        on_dev += lex.predict_proba(dev.pairs) / 5
        meta.append({"fold": k, "fit_rows": len(part), "rounds": lex.rounds, "s": round(time.perf_counter() - t0, 1)})
        print(meta[-1], flush=True)
    np.save(CACHE / "train_P.npy", oof)
    np.save(CACHE / "dev_P.npy", on_dev)
    np.save(CACHE / "train_fold.npy", fold)
    (CACHE / "trees.json").write_text(json.dumps(meta, indent=1) + "\n")


def softmax(L: np.ndarray) -> np.ndarray:
    p = np.exp(L - L.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def stackers():
    """name -> (feature blocks, kind): ridge on relevance (1..3) or multinomial logistic on the level."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    def logistic():
        return make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=500))

    return {
        "ridge L": (("L",), lambda: make_pipeline(StandardScaler(), Ridge(1.0))),
        "ridge L+P": (("L", "P"), lambda: make_pipeline(StandardScaler(), Ridge(1.0))),
        "logistic L": (("L",), lambda: make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=500))),
        "logistic L+P": (
            ("L", "logP"),
            lambda: make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=500)),
        ),
    }


def design(L: np.ndarray, P: np.ndarray, blocks) -> np.ndarray:
    parts = {"L": L, "P": P, "logP": np.log(np.clip(P, 1e-6, None))}
    return np.concatenate([parts[b] for b in blocks], axis=1)


def predict(model, X: np.ndarray, logistic: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """(relevance 1..3, level distribution or None)."""
    if logistic:
        p = model.predict_proba(X)
        return 1 + (p @ np.arange(5)) / 2, p
    return np.clip(model.predict(X), 1.0, 3.0), None


def figures(ds, rel: np.ndarray) -> dict:
    """RMSE on 1..3, QWK of cut points fitted on one half of the queries and applied to the other (as
    `qtrel calibrate` reports it), NDCG@10 of the score."""
    import torch

    from model.train.calibrate import crossfit_qwk
    from model.train.metrics import mean_ndcg

    y = np.array([e.relevance for e in ds.examples])
    expected = 1 + 2 * (rel - 1)
    return {
        "rmse_relevance": round(float(np.sqrt(np.mean((rel - y) ** 2))), 4),
        "qwk_crossfit": round(crossfit_qwk(ds, torch.tensor(expected), 5, 0.02), 4),
        "ndcg@10": round(mean_ndcg([e.query for e in ds.examples], ds.labels, expected.tolist()), 4),
    }


def teacher(out: str, json_out: str | None) -> None:
    """Every stacker cross-fitted by query on train (out of fold), and fitted on all of train then applied
    to dev; the teacher file holds "ridge L+P"'s relevance and "logistic L+P"'s distribution, out of fold."""
    train, dev = read_labelled(TRAIN, LABELS), read_labelled(DEV, LABELS)
    Lt, Pt, fold = (
        np.load(CACHE / "train_L.npy").astype(np.float64),
        np.load(CACHE / "train_P.npy"),
        np.load(CACHE / "train_fold.npy"),
    )
    Ld, Pd = np.load(CACHE / "dev_L.npy").astype(np.float64), np.load(CACHE / "dev_P.npy")
    yt_rel = np.array([e.relevance for e in train.examples])
    yt_lvl = np.array(train.labels)
    res: dict = {"model alone": {}, "trees alone": {}}
    for name, ds, L, P in (("train_oof", train, Lt, Pt), ("dev", dev, Ld, Pd)):
        res["model alone"][name] = figures(ds, 1 + (softmax(L) @ np.arange(5)) / 2)
        res["trees alone"][name] = figures(ds, 1 + (P @ np.arange(5)) / 2)
    kept: dict = {}
    for name, (blocks, make) in stackers().items():
        logistic = name.startswith("logistic")
        y = yt_lvl if logistic else yt_rel
        Xt, Xd = design(Lt, Pt, blocks), design(Ld, Pd, blocks)
        rel_oof, p_oof = np.zeros(len(train)), np.zeros((len(train), 5))
        for k in range(5):
            tr, te = np.flatnonzero(fold != k), np.flatnonzero(fold == k)
            r, p = predict(make().fit(Xt[tr], y[tr]), Xt[te], logistic)
            rel_oof[te] = r
            if p is not None:
                p_oof[te] = p
        full = make().fit(Xt, y)
        rel_dev, _ = predict(full, Xd, logistic)
        res[name] = {"train_oof": figures(train, rel_oof), "dev": figures(dev, rel_dev)}
        kept[name] = (rel_oof, p_oof)
        print(name, res[name], flush=True)
    print("model alone", res["model alone"], "\ntrees alone", res["trees alone"], flush=True)
    write_teacher(out, train, kept["ridge L+P"][0], kept["logistic L+P"][1])
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1) + "\n")


def teacher_dev_half(out: str, json_out: str | None) -> None:
    """The fallback when the train-fitted stacker loses to the model on dev (the model's logits on train are
    in-sample: it was trained there). The stackers are fitted on one half of the dev queries (A, honest
    logits; `model.train.calibrate.query_halves`, seed 0), checked on the other half (B) against the model
    alone, and applied to train's logits and out-of-fold tree probabilities to make the teacher file.
    Half B never reaches the teacher: it is the leakage-free dev check of the student."""
    from model.train.calibrate import query_halves

    train, dev = read_labelled(TRAIN, LABELS), read_labelled(DEV, LABELS)
    Lt, Pt = np.load(CACHE / "train_L.npy").astype(np.float64), np.load(CACHE / "train_P.npy")
    Ld, Pd = np.load(CACHE / "dev_L.npy").astype(np.float64), np.load(CACHE / "dev_P.npy")
    a, b = (np.array(h) for h in query_halves(dev, 0))
    y_rel, y_lvl = np.array([e.relevance for e in dev.examples]), np.array(dev.labels)
    half = {n: type(dev)([dev.examples[i] for i in idx], dev.path) for n, idx in (("A", a), ("B", b))}
    res: dict = {"halves": {"A": len(a), "B": len(b)}, "model alone": {}}
    for n, idx in (("A", a), ("B", b)):
        res["model alone"][n] = figures(half[n], 1 + (softmax(Ld[idx]) @ np.arange(5)) / 2)
    kept = {}
    for name, (blocks, make) in stackers().items():
        logistic = name.startswith("logistic")
        Xd, Xt = design(Ld, Pd, blocks), design(Lt, Pt, blocks)
        fitted = make().fit(Xd[a], (y_lvl if logistic else y_rel)[a])
        rel_b, _ = predict(fitted, Xd[b], logistic)
        rel_t, p_t = predict(fitted, Xt, logistic)
        res[name] = {"B": figures(half["B"], rel_b), "train": figures(train, rel_t)}
        kept[name] = (rel_t, p_t)
        print(name, res[name], flush=True)
    print("model alone", res["model alone"], flush=True)
    write_teacher(out, train, kept["ridge L+P"][0], kept["logistic L+P"][1])
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1) + "\n")


def halves(checkpoints: list[str], json_out: str | None) -> None:
    """The leakage-free check of a (calibrated) student: RMSE, cross-fitted QWK and NDCG@10 of its expected
    level on dev half B (the queries the dev-half teacher never saw) and half A, beside model/default's."""
    import torch

    from model.relevance import RelevanceModel
    from model.scoring import merge_classes
    from model.train.calibrate import class_logits, pairs_of, query_halves

    torch.set_num_threads(1)
    dev = read_labelled(DEV, LABELS)
    res = {}
    for ck in ["model/default", *checkpoints]:
        m = RelevanceModel.load(ck, dtype="float32")
        L = merge_classes(class_logits(m, pairs_of(dev.examples)), m.class_levels).double().numpy()
        rel = 1 + (softmax(L) @ np.arange(5)) / 2
        res[ck] = {}
        for n, idx in zip("AB", query_halves(dev, 0)):
            sub = type(dev)([dev.examples[i] for i in idx], dev.path)
            res[ck][n] = figures(sub, rel[np.array(idx)])
        res[ck]["all"] = figures(dev, rel)
        print(ck, res[ck], flush=True)
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1) + "\n")


def write_teacher(out: str, train, rel: np.ndarray, probs: np.ndarray) -> None:
    import csv

    with open(out, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["query", "title", "relevance", *[f"p_{x}" for x in LABELS]])
        for e, r, p in zip(train.examples, rel, probs):
            w.writerow([e.query, e.title, f"{r:.5f}", *[f"{v:.6f}" for v in p / p.sum()]])
    print(f"wrote {out}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["logits", "trees", "teacher", "teacher-dev-half", "halves"])
    ap.add_argument("checkpoints", nargs="*", help="halves: calibrated students to compare with model/default")
    ap.add_argument("--out", default="/tmp/distill-runs/teacher.csv", help="the teacher file (qtrel train --teacher)")
    ap.add_argument("--json", help="write the teacher's figures here")
    a = ap.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    if a.step == "logits":
        logits()
    elif a.step == "trees":
        trees()
    elif a.step == "teacher":
        teacher(a.out, a.json)
    elif a.step == "teacher-dev-half":
        teacher_dev_half(a.out, a.json)
    else:
        halves(a.checkpoints, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
