"""Can the lexical baseline run without scikit-learn at inference? Export a fitted
HistGradientBoostingClassifier's trees to plain arrays (JSON), predict with numpy alone, and check it
against sklearn's predict_proba; and what the baseline costs per 1,000 pairs, one thread: the features
(LexicalBaseline.features, pure Python), sklearn's predict_proba on precomputed features, and the numpy
trees, batched and one pair at a time. Nothing here ships.

    OMP_NUM_THREADS=1 python lab/lexical_trees_numpy.py [--out /tmp/lexstack/trees.json]
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

from calibration_variants import DEV, off_domain_pairs  # noqa: E402

from model.data import read_labelled  # noqa: E402
from model.train.baseline import LexicalBaseline  # noqa: E402
from model.train.calibrate import pairs_of  # noqa: E402
from model.train.negatives import sample_negatives  # noqa: E402

LABELS = ["1", "2", "3", "4", "5"]
FIELDS = ("feature_idx", "num_threshold", "missing_go_to_left", "left", "right", "value", "is_leaf")


def export_trees(clf) -> dict:
    """A fitted HistGradientBoostingClassifier (numeric features only) -> JSON-able dict of plain lists."""
    if getattr(clf, "is_categorical_", None) is not None and np.any(clf.is_categorical_):
        raise ValueError("categorical splits are not exported")
    trees = []
    for per_class in clf._predictors:
        for k, pred in enumerate(per_class):
            n = pred.nodes
            trees.append({"class": k, **{f: n[f].tolist() for f in FIELDS}})
    return {
        "format": "qtrel-lexical-trees/1",
        "classes": clf.classes_.tolist(),
        "n_classes": int(clf.n_trees_per_iteration_),
        "n_features": int(clf.n_features_in_),
        "baseline": np.asarray(clf._baseline_prediction, dtype=np.float64).ravel().tolist(),
        "trees": trees,
    }


class NumpyTrees:
    """The exported trees as flat arrays: all trees walked together, one depth level per step."""

    def __init__(self, d: dict):
        self.k = d["n_classes"]
        self.baseline = np.array(d["baseline"], dtype=np.float64)
        offs, cols = [], {f: [] for f in FIELDS}
        base = 0
        self.cls = np.array([t["class"] for t in d["trees"]], dtype=np.int64)
        for t in d["trees"]:
            offs.append(base)
            for f in FIELDS:
                v = np.asarray(t[f])
                cols[f].append(v + base if f in ("left", "right") else v)
            base += len(t["value"])
        self.root = np.array(offs, dtype=np.int64)
        self.onehot = (self.cls[None, :] == np.arange(self.k)[:, None]).astype(np.float64)  # (k, trees)
        self.feat = np.concatenate(cols["feature_idx"]).astype(np.int64)
        self.thr = np.concatenate(cols["num_threshold"]).astype(np.float64)
        self.mleft = np.concatenate(cols["missing_go_to_left"]).astype(bool)
        self.left = np.concatenate(cols["left"]).astype(np.int64)
        self.right = np.concatenate(cols["right"]).astype(np.int64)
        self.value = np.concatenate(cols["value"]).astype(np.float64)
        self.leaf = np.concatenate(cols["is_leaf"]).astype(bool)
        # a leaf points to itself, so the walk can run a fixed number of steps
        ids = np.arange(len(self.value))
        self.left[self.leaf] = ids[self.leaf]
        self.right[self.leaf] = ids[self.leaf]
        self.feat[self.leaf] = 0
        self.depth = int(max(np.max(np.asarray(t_depth)) for t_depth in [self._depths(d)]))

    @staticmethod
    def _depths(d: dict) -> list[int]:
        out = []
        for t in d["trees"]:
            depth = {0: 0}
            for i, leaf in enumerate(t["is_leaf"]):
                if not leaf:
                    depth[t["left"][i]] = depth[i] + 1
                    depth[t["right"][i]] = depth[i] + 1
            out.append(max(depth.values()))
        return out

    def raw(self, X: np.ndarray) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        n = X.shape[0]
        idx = np.broadcast_to(self.root[:, None], (len(self.root), n)).copy()  # (trees, n)
        rows = np.arange(n)[None, :]
        for _ in range(self.depth):
            x = X[rows, self.feat[idx]]
            go_left = np.where(np.isnan(x), self.mleft[idx], x <= self.thr[idx])
            idx = np.where(go_left, self.left[idx], self.right[idx])
        return self._finish(idx, n)

    def raw_compact(self, X: np.ndarray) -> np.ndarray:
        """The same walk, but each step only moves the (tree, row) entries not yet at a leaf."""
        X = np.asarray(X, dtype=np.float64)
        n = X.shape[0]
        T = len(self.root)
        idx = np.repeat(self.root, n).astype(np.int32)  # flat (tree, row), row fastest
        row = np.tile(np.arange(n, dtype=np.int32), T)
        nf = X.shape[1]
        flat = X.ravel()
        act = np.flatnonzero(~self.leaf[idx])
        while act.size:
            node = idx[act]
            x = flat[row[act] * nf + self.feat[node]]
            go_left = np.where(np.isnan(x), self.mleft[node], x <= self.thr[node])
            nxt = np.where(go_left, self.left[node], self.right[node])
            idx[act] = nxt
            act = act[~self.leaf[nxt]]
        return self._finish(idx.reshape(T, n), n)

    def _finish(self, idx, n):
        vals = self.value[idx]  # (trees, n)
        return (self.onehot @ vals).T + self.baseline

    def predict_proba(self, X: np.ndarray, compact: bool = True) -> np.ndarray:
        r = self.raw_compact(X) if compact else self.raw(X)
        r -= r.max(1, keepdims=True)
        e = np.exp(r)
        return e / e.sum(1, keepdims=True)


def per_1000(fn, pairs, reps: int = 1) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(pairs)
        best = min(best, time.perf_counter() - t0)
    return best / len(pairs) * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/lexstack/trees.json")
    a = ap.parse_args()
    from threadpoolctl import threadpool_limits

    dev = read_labelled(DEV, LABELS)
    train = read_labelled(DEV.with_name("train.csv"), LABELS)
    t0 = time.perf_counter()
    lex = LexicalBaseline(LABELS, threads=1).fit(train)
    print(f"baseline fit on train.csv: {time.perf_counter() - t0:.1f} s, {lex.rounds} rounds", flush=True)
    clf = lex._clf
    d = export_trees(clf)
    Path(a.out).write_text(json.dumps(d))
    size = Path(a.out).stat().st_size
    print(
        f"exported {len(d['trees'])} trees, {sum(len(t['value']) for t in d['trees'])} nodes, {size / 1e6:.2f} MB JSON"
    )
    nt = NumpyTrees(json.loads(Path(a.out).read_text()))
    print(f"max depth {nt.depth}")

    pairs = pairs_of(dev.examples)
    neg = pairs_of(sample_negatives(dev, 0.25, seed=0))
    off = off_domain_pairs()
    allp = pairs + neg + off
    X = lex.features(allp)
    with threadpool_limits(1):
        ps = clf.predict_proba(X)
    pn = nt.predict_proba(X)
    err = max(np.abs(ps - pn).max(), np.abs(ps - nt.predict_proba(X, compact=False)).max())
    print(f"numpy vs sklearn predict_proba on {len(allp)} pairs (dev, negatives, off-domain): max abs diff {err:.3g}")
    # one pair at a time too (the service's shape)
    one = max(np.abs(nt.predict_proba(X[i : i + 1]) - ps[i : i + 1]).max() for i in range(0, len(X), 97))
    print(f"  one row at a time (every 97th row): max abs diff {one:.3g}")
    # NaN rows and extremes: features absent, huge values
    Xe = X[:200].copy()
    Xe[::3, :] = np.nan
    Xe[1::3, :] = 1e9
    with threadpool_limits(1):
        ee = np.abs(clf.predict_proba(Xe) - nt.predict_proba(Xe)).max()
    print(f"  all-NaN / 1e9 rows: max abs diff {ee:.3g}")

    # cost, one thread
    sub = pairs[:2000]
    Xs = lex.features(sub)
    t_feat = per_1000(lex.features, sub, 3)
    with threadpool_limits(1):
        t_sk = per_1000(lambda p: clf.predict_proba(Xs), sub, 5)
        t_sk1 = (
            min(
                (lambda t0: (clf.predict_proba(Xs[i : i + 1]), time.perf_counter() - t0)[1])(time.perf_counter())
                for i in range(200)
            )
            * 1000
        )
        t_sk1_med = (
            float(
                np.median(
                    [
                        (lambda t0: (clf.predict_proba(Xs[i : i + 1]), time.perf_counter() - t0)[1])(
                            time.perf_counter()
                        )
                        for i in range(200)
                    ]
                )
            )
            * 1000
        )
    t_np = per_1000(lambda p: nt.predict_proba(Xs), sub, 5)
    t_np_full = per_1000(lambda p: nt.predict_proba(Xs, compact=False), sub, 3)
    t_np1 = (
        float(
            np.median(
                [
                    (lambda t0: (nt.predict_proba(Xs[i : i + 1]), time.perf_counter() - t0)[1])(time.perf_counter())
                    for i in range(200)
                ]
            )
        )
        * 1000
    )
    t_np32 = (
        float(
            np.median(
                [
                    (lambda t0: (nt.predict_proba(Xs[i : i + 32]), time.perf_counter() - t0)[1])(time.perf_counter())
                    for i in range(0, 1600, 32)
                ]
            )
        )
        * 1000
        / 32
        * 1000
    )
    res = {
        "features_s_per_1000": t_feat,
        "sklearn_proba_s_per_1000_batched": t_sk,
        "sklearn_proba_ms_one_row_median": t_sk1_med,
        "sklearn_proba_ms_one_row_best": t_sk1,
        "numpy_proba_s_per_1000_batched": t_np,
        "numpy_proba_s_per_1000_batched_fixed_depth_walk": t_np_full,
        "numpy_proba_ms_one_row_median": t_np1,
        "numpy_proba_s_per_1000_in_batches_of_32": t_np32 / 1000,
        "max_abs_diff": float(err),
        "max_abs_diff_one_row": float(one),
        "max_abs_diff_extremes": float(ee),
        "trees": len(d["trees"]),
        "json_bytes": size,
    }
    print(json.dumps(res, indent=1))
    Path(a.out).with_name("trees_cost.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
