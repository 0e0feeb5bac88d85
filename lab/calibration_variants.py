"""Post-hoc calibration variants of a checkpoint on dev, judged pairs and sampled negatives side by side.

For each variant: RMSE on the 1..3 scale and NDCG@10 of the judged pairs (and RMSE after an isotonic map
of the score, cross-fitted on halves of the queries), QWK of the level rule (cut points fitted on dev, and
cross-fitted), the share of each level, how sampled negatives are graded (share at level 1 and 1-2, AUC
judged vs negative) and the hand-written off-domain titles (tests/data/off_domain_titles.csv: how many at
level 1 and 1-2, mean p(level 1)). Logits are computed once per checkpoint.

    python lab/calibration_variants.py model/default runs/v2 --out docs/bench/calibration_variants.json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.data import read_labelled  # noqa: E402
from model.relevance import RelevanceModel  # noqa: E402
from model.scoring import LevelRule, fit_cuts, score_logits  # noqa: E402
from model.train.calibrate import (  # noqa: E402
    calibrated,
    class_logits,
    crossfit_qwk,
    fit_temperature,
    fit_vector_scaling,
    isotonic_rmse,
    pairs_of,
)
from model.train.evaluate import metrics_of, negatives_report  # noqa: E402
from model.train.negatives import sample_negatives  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEV = ROOT.parent / "shared" / "data" / "homedepot" / "dev.csv"
OFF_DOMAIN = ROOT / "tests" / "data" / "off_domain_titles.csv"


def off_domain_pairs() -> list[tuple[str, str]]:
    with OFF_DOMAIN.open(encoding="utf-8") as f:
        return [(r["query"], r["title"]) for r in csv.DictReader(f)]


def variants(
    judged: torch.Tensor, neg: torch.Tensor, y: torch.Tensor, neg_class: int = 0
) -> dict[str, tuple[float, torch.Tensor]]:
    """name -> (temperature, bias per class) fitted on dev. A head with a "not a candidate" class
    (`neg_class`, model.config) is fitted with the negatives in every variant: judged pairs never show it."""
    k = judged.shape[1]
    both = torch.cat([judged, neg])
    yy = torch.cat([y, torch.full((len(neg),), neg_class, dtype=torch.long)])
    out = {"raw": (1.0, torch.zeros(k))}
    if neg_class:
        out["temperature (judged + negatives)"] = (fit_temperature(both, yy), torch.zeros(k))
    else:
        out["temperature"] = (fit_temperature(judged, y), torch.zeros(k))
        out["vector (judged)"] = fit_vector_scaling(judged, y)
    for w in (0.1, 0.3, 1.0) if neg_class else (0.1, 0.3):
        weights = torch.cat([torch.ones(len(judged)), torch.full((len(neg),), w)])
        out[f"vector (judged + {w} x negatives)"] = fit_vector_scaling(both, yy, weights)
    return out


def report(path: str, ds, negs, min_share: float) -> dict:
    model = RelevanceModel.load(path)
    judged = class_logits(model, pairs_of(ds.examples))
    neg = class_logits(model, pairs_of(negs))
    off = class_logits(model, off_domain_pairs())
    y = torch.tensor(ds.labels)
    rows = {}
    for name, (t, b) in variants(judged, neg, y, model.cfg.negative_class).items():
        sj = score_logits(calibrated(model, judged, t, b), model.values, LevelRule())
        cuts = fit_cuts(sj.expected.tolist(), ds.labels, len(model.labels), min_share)
        rule = LevelRule(cuts)
        sj = score_logits(calibrated(model, judged, t, b), model.values, rule)
        sn = score_logits(calibrated(model, neg, t, b), model.values, rule)
        so = score_logits(calibrated(model, off, t, b), model.values, rule)
        m = metrics_of(ds, sj)
        iso = isotonic_rmse(ds, sj.expected, len(model.labels))
        rows[name] = {
            "temperature": round(t, 4),
            "bias": [round(x, 4) for x in b.tolist()],
            "cuts": [round(c, 4) for c in cuts],
            "rmse_relevance": m["rmse_relevance"],
            "rmse_isotonic_crossfit": iso["rmse_isotonic_crossfit"],
            "ndcg@10": m["ndcg@10"],
            "qwk_cuts": m["qwk"],
            "qwk_crossfit": crossfit_qwk(ds, sj.expected, len(model.labels), min_share),
            "log_loss": torch.nn.functional.cross_entropy(calibrated(model, judged, t, b), y).item(),
            "level_shares": (torch.bincount(sj.level, minlength=len(model.labels)) / len(ds)).tolist(),
            "negatives": negatives_report(ds, sj, negs, sn),
            "off_domain": {
                "n": len(so.level),
                "level1": int((so.level == 0).sum()),
                "level12": int((so.level <= 1).sum()),
                "mean_p_level1": so.probs[:, 0].mean().item(),
                "max_score": so.expected.max().item(),
            },
        }
        r = rows[name]
        print(
            f"{path:24s} {name:32s} rmse {r['rmse_relevance']:.4f} (iso x-fit {r['rmse_isotonic_crossfit']:.4f}) "
            f"ndcg {r['ndcg@10']:.4f} qwk {r['qwk_cuts']:.4f} (x-fit {r['qwk_crossfit']:.4f}) "
            f"neg1 {r['negatives']['level1_share']:.3f} neg12 {r['negatives']['level12_share']:.3f} "
            f"auc {r['negatives']['auc']:.4f} off1 {r['off_domain']['level1']}/{r['off_domain']['n']} "
            f"p1 {r['off_domain']['mean_p_level1']:.2f} shares {[round(x, 3) for x in r['level_shares']]}",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--data", default=str(DEV))
    ap.add_argument("--negatives", type=float, default=1.0)
    ap.add_argument("--min-share", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ds = read_labelled(a.data, ["1", "2", "3", "4", "5"])
    negs = sample_negatives(ds, a.negatives, seed=0)
    res = {p: report(p, ds, negs, a.min_share) for p in a.checkpoints}
    if a.out:
        Path(a.out).write_text(json.dumps({"data": a.data, "negatives": len(negs), "results": res}, indent=1) + "\n")


if __name__ == "__main__":
    main()
