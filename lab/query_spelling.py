"""Does correcting the queries' spelling help the shipped model? (issue 23; the model card's "spelling
correction" row.) Writes a copy of a labelled file with each query word that neither train's titles nor its
queries use corrected to the most frequent catalogue word within edit distance 1 (else a split into two
common words, else distance 2); then compare `qtrel eval` on both files.

    python lab/query_spelling.py ../shared/data/homedepot/dev.csv /tmp/dev-spelled.csv
    qtrel eval model/default /tmp/dev-spelled.csv --negatives 0
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
from pathlib import Path

TRAIN = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "homedepot" / "train.csv"
WORD = re.compile(r"[a-z]+")
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def words(s: str) -> list[str]:
    return WORD.findall(s.lower())


def edits1(w: str) -> set[str]:
    s = [(w[:i], w[i:]) for i in range(len(w) + 1)]
    return set(
        [a + b[1:] for a, b in s if b]
        + [a + b[1] + b[0] + b[2:] for a, b in s if len(b) > 1]
        + [a + c + b[1:] for a, b in s if b for c in LETTERS]
        + [a + c + b for a, b in s for c in LETTERS]
    )


class Speller:
    def __init__(self, train: Path, min_count: int = 3):
        rows = list(csv.DictReader(train.open(encoding="utf-8")))
        self.titles, self.queries = collections.Counter(), collections.Counter()
        for r in rows:
            self.titles.update(words(r["title"]))
        for q in {r["query"].lower() for r in rows}:
            self.queries.update(set(words(q)))
        self.min = min_count
        self.cache: dict[str, str] = {}

    def known(self, w: str) -> bool:
        seen = self.titles[w] >= self.min or self.queries[w] >= 3
        return seen or (w.endswith("s") and (self.titles[w[:-1]] >= self.min or self.queries[w[:-1]] >= 3))

    def correct(self, w: str) -> str:
        if len(w) < 4 or self.known(w):
            return w
        found = [e for e in edits1(w) if self.titles[e] >= self.min]
        if not found:
            f = self.titles
            split = [(f[w[:i]] * f[w[i:]], f"{w[:i]} {w[i:]}") for i in range(2, len(w) - 1)]
            split = [x for x in split if x[0] and f[x[1].split()[0]] >= 20 and f[x[1].split()[1]] >= 20]
            if split:
                return max(split)[1]
            found = [e2 for e in edits1(w) for e2 in edits1(e) if self.titles[e2] >= 20]
        return max(found, key=self.titles.__getitem__) if found else w

    def fix(self, query: str) -> str:
        out = query
        for w in set(words(query)):
            if w not in self.cache:
                self.cache[w] = self.correct(w)
            if self.cache[w] != w:
                out = re.sub(rf"(?i)\b{w}\b", self.cache[w], out)
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--train", default=str(TRAIN))
    a = p.parse_args()
    speller = Speller(Path(a.train))
    rows = list(csv.DictReader(open(a.data, encoding="utf-8")))
    changed = 0
    with open(a.out, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            fixed = speller.fix(r["query"])
            changed += fixed != r["query"]
            w.writerow({**r, "query": fixed})
    print(f"{changed} of {len(rows)} pairs' queries changed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
