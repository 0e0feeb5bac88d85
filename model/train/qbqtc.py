"""The QQ Browser query-title data (QBQTC, CLUE) as one deduplicated set with a query-disjoint held-out split.

Three files are here: the final release's dev.json (label field `label`) and the old release's train.json and
dev.json (field `relevant`); labels 0/1/2 are levels 1..3. Some (query, title) pairs occur in more than one
file, or twice in one: each pair is kept once, with the label most of its rows give (a tie goes to the
final release, whose guidelines are the published ones). Queries whose hash falls under `held_out`
percent form the evaluation split; no query crosses it.

    python -m model.train.qbqtc ../shared/data/qbqtc OUT   # writes OUT/train.jsonl, OUT/heldout.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

FILES = (
    ("dev.json", "label", "final"),
    ("old_v1/train.json", "relevant", "old"),
    ("old_v1/dev.json", "relevant", "old"),
)
HELD_OUT_PERCENT = 12
LEVELS = ("1", "2", "3")  # label 0/1/2


def held_out(query: str, percent: int = HELD_OUT_PERCENT, salt: str = "") -> bool:
    """Whether `query` belongs to the evaluation split: a stable hash of its stripped, lower-cased text."""
    h = hashlib.sha1((salt + query.strip().lower()).encode("utf-8")).digest()
    return int.from_bytes(h[:4], "big") % 100 < percent


def merge(root: Path) -> tuple[list[dict], dict]:
    """Every (query, title) pair once, with its resolved label 0..2, and counts of what was merged."""
    votes: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
    rows: Counter[str] = Counter()
    for name, field, release in FILES:
        with open(root / name, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                r = json.loads(line)
                label = int(r[field])
                if label not in (0, 1, 2):
                    raise ValueError(f"{name}: label {label!r} is not 0, 1 or 2")
                votes[(r["query"].strip(), r["title"].strip())].append((label, release))
                rows[name] += 1
    pairs: list[dict] = []
    stats: Counter[str] = Counter()
    for (q, t), vs in votes.items():
        if len(vs) > 1:
            stats["duplicated_pairs"] += 1
            stats["duplicate_rows_dropped"] += len(vs) - 1
        labels = Counter(v for v, _ in vs)
        top = labels.most_common()
        if len(labels) > 1:
            stats["conflicting_pairs"] += 1
        if len(top) > 1 and top[0][1] == top[1][1]:
            tied = {v for v, c in top if c == top[0][1]}
            final = [v for v, rel in vs if rel == "final" and v in tied]
            label = final[0] if final else min(tied)
            stats["ties_resolved"] += 1
        else:
            label = top[0][0]
        pairs.append({"query": q, "title": t, "label": label})
    stats.update({f"rows_{k}": v for k, v in rows.items()})
    stats["pairs"] = len(pairs)
    return pairs, dict(stats)


def split(pairs: list[dict], percent: int = HELD_OUT_PERCENT) -> tuple[list[dict], list[dict]]:
    train = [p for p in pairs if not held_out(p["query"], percent)]
    heldout = [p for p in pairs if held_out(p["query"], percent)]
    return train, heldout


def write(root: Path, out: Path, percent: int = HELD_OUT_PERCENT, calib_percent: int = 0) -> dict:
    """train.jsonl and heldout.jsonl; with `calib_percent`, that share of the training queries (another
    hash) goes to calib.jsonl instead: pairs to fit the head's class biases on (model.train.class_bias)."""
    pairs, stats = merge(root)
    train, heldout = split(pairs, percent)
    calib = [p for p in train if held_out(p["query"], calib_percent, salt="calib:")]
    train = [p for p in train if not held_out(p["query"], calib_percent, salt="calib:")]
    out.mkdir(parents=True, exist_ok=True)
    parts = (("train", train), ("heldout", heldout)) + ((("calib", calib),) if calib_percent else ())
    for name, part in parts:
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for p in part:
                f.write(json.dumps(p, ensure_ascii=False) + "\n")
    for name, part in parts:
        stats[f"{name}_pairs"] = len(part)
        stats[f"{name}_queries"] = len({p["query"] for p in part})
        stats[f"{name}_labels"] = [sum(p["label"] == c for p in part) for c in range(3)]
    return stats


def read(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root", type=Path, help="the qbqtc folder (dev.json, old_v1/)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--held-out-percent", type=int, default=HELD_OUT_PERCENT)
    ap.add_argument("--calib-percent", type=int, default=0, help="of the training queries, for calib.jsonl")
    args = ap.parse_args(argv)
    print(json.dumps(write(args.root, args.out, args.held_out_percent, args.calib_percent), indent=1))


if __name__ == "__main__":
    main()
