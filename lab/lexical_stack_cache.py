"""Cache for lab/lexical_stack_negatives.py: model/default's logits and the lexical baseline's features and
tree probabilities on dev, sampled negatives (evaluation and fit sets, random and foreign) and the
off-domain titles, as /tmp/lexstack/*.npy. One thread throughout.

    OMP_NUM_THREADS=1 python lab/lexical_stack_cache.py [model/default]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibration_variants import DEV, off_domain_pairs  # noqa: E402

from model.data import read_labelled  # noqa: E402
from model.relevance import RelevanceModel  # noqa: E402
from model.train.baseline import LexicalBaseline  # noqa: E402
from model.train.calibrate import class_logits, pairs_of  # noqa: E402
from model.train.negatives import sample_foreign_negatives, sample_negatives, vocabulary_words  # noqa: E402

LABELS = ["1", "2", "3", "4", "5"]
OUT = Path("/tmp/lexstack")


def sets(dev, words):
    """name -> list of (query, title); negatives as Examples are kept for their queries."""
    return {
        "dev": pairs_of(dev.examples),
        "neg_eval": pairs_of(sample_negatives(dev, 0.25, seed=0)),  # = qtrel eval --negatives 0.25 (seed 0)
        "neg_fit": pairs_of(sample_negatives(dev, 1.0, seed=11)),  # for the stacker's fit only
        "foreign_fit": pairs_of(sample_foreign_negatives(dev, 0.25, seed=12, words=words)),
        "foreign_eval": pairs_of(sample_foreign_negatives(dev, 0.25, seed=13, words=words)),
        "off": off_domain_pairs(),
    }


def main() -> int:
    torch.set_num_threads(1)
    ck = sys.argv[1] if len(sys.argv) > 1 else "model/default"
    OUT.mkdir(parents=True, exist_ok=True)
    dev = read_labelled(DEV, LABELS)
    train = read_labelled(DEV.with_name("train.csv"), LABELS)
    m = RelevanceModel.load(ck, dtype="float32")
    words = vocabulary_words(m.tokenizer.vocabulary())
    S = sets(dev, words)
    t0 = time.perf_counter()
    lex = LexicalBaseline(LABELS, threads=1).fit(train)
    print(f"baseline fit {time.perf_counter() - t0:.1f}s rounds {lex.rounds}", flush=True)
    meta = {"checkpoint": ck, "rounds": lex.rounds}
    for name, pairs in S.items():
        (OUT / f"{name}_pairs.json").write_text(json.dumps(pairs))
        t0 = time.perf_counter()
        F = lex.features(pairs)
        tf = time.perf_counter() - t0
        t0 = time.perf_counter()
        P = lex.predict_proba(pairs)  # recomputes the features inside
        tp = time.perf_counter() - t0
        t0 = time.perf_counter()
        L = class_logits(m, pairs).float().numpy()
        tl = time.perf_counter() - t0
        np.save(OUT / f"{name}_F.npy", F)
        np.save(OUT / f"{name}_P.npy", P)
        np.save(OUT / f"{name}_L.npy", L)
        meta[name] = {"n": len(pairs), "features_s": tf, "proba_s": tp, "logits_s": tl}
        print(name, meta[name], flush=True)
    (OUT / "meta.json").write_text(json.dumps(meta, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
