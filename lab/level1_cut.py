"""Where to put the level-1 cut point: kappa on judged candidates against grading unrelated titles 1.

For each calibration of a checkpoint's logits (temperature; vector scaling on the judged pairs; vector
scaling with sampled negatives mixed in) and each way of setting the first cut point (fitted for kappa
with the others, or pinned at the 90th / 95th percentile of sampled negatives' scores, as
`qtrel calibrate --unrelated`), one line: RMSE on the 1..3 scale (and after a cross-fitted isotonic map),
QWK, NDCG@10, the share of *other* sampled negatives (another seed) at level 1 and 1-2, their AUC, and the
hand-written off-domain titles (tests/data/off_domain_titles.csv) at level 1 and 1-2 with their mean
p(level 1). Logits are computed once per checkpoint.

    python lab/level1_cut.py model/default runs/v3a/step-4722 --out docs/bench/level1_cut.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration_variants import DEV, off_domain_pairs, variants  # noqa: E402  (the bench folder is on the path)

from model.data import read_labelled  # noqa: E402
from model.relevance import RelevanceModel  # noqa: E402
from model.scoring import LevelRule, fit_cuts, score_logits  # noqa: E402
from model.train.calibrate import calibrated, class_logits, isotonic_rmse, pairs_of  # noqa: E402
from model.train.evaluate import metrics_of, negatives_report  # noqa: E402
from model.train.negatives import sample_negatives  # noqa: E402


def sweep(path: str, ds, fit_negs, test_negs, off_pairs) -> list[dict]:
    m = RelevanceModel.load(path)
    judged = class_logits(m, pairs_of(ds.examples))
    neg = class_logits(m, pairs_of(fit_negs))
    test = class_logits(m, pairs_of(test_negs))
    off = class_logits(m, off_pairs)
    y = torch.tensor(ds.labels)
    k = len(m.labels)
    calibrations = {name: tb for name, tb in variants(judged, neg, y, m.cfg.negative_class).items() if name != "raw"}
    rows = []
    for name, (t, b) in calibrations.items():
        plain_j = score_logits(calibrated(m, judged, t, b), m.values, LevelRule())
        plain_n = score_logits(calibrated(m, neg, t, b), m.values, LevelRule())
        for share in (None, 0.9, 0.95):
            fixed = None if share is None else {0: float(torch.quantile(plain_n.expected.double(), share))}
            rule = LevelRule(fit_cuts(plain_j.expected.tolist(), ds.labels, k, 0.02, fixed=fixed))
            sj, sn, so = (score_logits(calibrated(m, x, t, b), m.values, rule) for x in (judged, test, off))
            mm = metrics_of(ds, sj)
            negs = negatives_report(ds, sj, test_negs, sn)
            row = {
                "checkpoint": path,
                "calibration": name,
                "unrelated_share": share,
                "cuts": [round(c, 4) for c in rule.cuts],
                "rmse_relevance": mm["rmse_relevance"],
                "rmse_isotonic_crossfit": isotonic_rmse(ds, sj.expected, k)["rmse_isotonic_crossfit"],
                "qwk": mm["qwk"],
                "ndcg@10": mm["ndcg@10"],
                "negatives_level1": negs["level1_share"],
                "negatives_level12": negs["level12_share"],
                "auc": negs["auc"],
                "off_domain_level1": int((so.level == 0).sum()),
                "off_domain_level12": int((so.level <= 1).sum()),
                "off_domain_p1": so.probs[:, 0].mean().item(),
                "level_shares": (torch.bincount(sj.level, minlength=k) / len(sj.level)).tolist(),
            }
            rows.append(row)
            print(
                f"{path} {name:14s} share={share} rmse {row['rmse_relevance']:.4f} "
                f"(iso {row['rmse_isotonic_crossfit']:.4f}) qwk {row['qwk']:.4f} ndcg {row['ndcg@10']:.4f} "
                f"neg1 {row['negatives_level1']:.3f} neg12 {row['negatives_level12']:.3f} auc {row['auc']:.4f} "
                f"off1 {row['off_domain_level1']} off12 {row['off_domain_level12']} p1 {row['off_domain_p1']:.2f}",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--data", default=str(DEV))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ds = read_labelled(a.data, ["1", "2", "3", "4", "5"])
    fit_negs, test_negs = sample_negatives(ds, 0.25, seed=0), sample_negatives(ds, 0.25, seed=1)
    rows = [r for p in a.checkpoints for r in sweep(p, ds, fit_negs, test_negs, off_domain_pairs())]
    if a.out:
        Path(a.out).write_text(json.dumps({"data": a.data, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
