"""Where a head's "not a candidate" class puts its probability: p(not a candidate) on judged dev pairs
(by the raters' level), sampled negatives and the hand-written off-domain titles, after vector scaling
fitted on judged pairs plus W x negatives, for several W; and RMSE on the 1..3 scale of the expected
level over all classes against the expected level over the five judged classes alone.

    python lab/not_candidate_share.py runs/v3d/step-1771
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calibration_variants import DEV, off_domain_pairs  # noqa: E402  (the bench folder)

from model.data import read_labelled  # noqa: E402
from model.relevance import RelevanceModel  # noqa: E402
from model.scoring import LevelRule, score_logits  # noqa: E402
from model.train.calibrate import calibrated, class_logits, fit_vector_scaling, pairs_of  # noqa: E402
from model.train.evaluate import metrics_of  # noqa: E402
from model.train.negatives import sample_negatives  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.checkpoint)
    nac = m.cfg.negative_class
    if not nac:
        sys.exit(f"{a.checkpoint} has no 'not a candidate' class")
    ds = read_labelled(DEV, m.labels)
    negs = sample_negatives(ds, 0.25, seed=0)
    judged = class_logits(m, pairs_of(ds.examples))
    neg = class_logits(m, pairs_of(negs))
    off = class_logits(m, off_domain_pairs())
    y = torch.tensor(ds.labels)
    k = len(m.labels)

    def rmse(logits: torch.Tensor) -> float:  # of the expected level, on the raters' 1..3 scale
        return metrics_of(ds, score_logits(logits, m.values, LevelRule()))["rmse_relevance"]

    both, yy = torch.cat([judged, neg]), torch.cat([y, torch.full((len(neg),), nac)])
    for w in (0.1, 0.3, 1.0, 3.0):
        t, b = fit_vector_scaling(both, yy, torch.cat([torch.ones(len(judged)), torch.full((len(neg),), w)]))
        pj, pn, po = ((x / t + b).softmax(-1) for x in (judged, neg, off))
        by_level = [round(pj[y == lv, nac].mean().item(), 3) for lv in range(k)]
        print(
            f"W {w}: p(not a candidate) judged mean {pj[:, nac].mean():.3f} median {pj[:, nac].median():.3f} "
            f"q90 {pj[:, nac].quantile(0.9):.3f}, by level {by_level}; negatives {pn[:, nac].mean():.3f}; "
            f"off-domain {po[:, nac].mean():.3f} | RMSE all classes {rmse(calibrated(m, judged, t, b)):.4f}, "
            f"judged classes only {rmse((judged / t + b)[:, :k]):.4f}",  # softmax over them: given a candidate
            flush=True,
        )


if __name__ == "__main__":
    main()
