"""What a cut-off keeps: precision and recall of `min_level` and `min_score` on a labelled file.

A search team drops results below a level or a score (the API's `min_level`, `min_score`). This measures,
for each level L, how many of the pairs the model grades >= L a person graded >= L too (precision), how
many of the person's >= L pairs the cut keeps (recall) and how many pairs it keeps at all; then the same
for a few thresholds on the expected level. The tables in docs/model-card.md come from

    python -m model.train.cutoffs ../shared/data/homedepot/dev.csv --model builtin:default --model builtin:pruned
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from model.levels import MAX_BATCH_TOKENS

SCORE_CUTS = (2.5, 3.0, 3.5, 3.75, 4.0, 4.25)  # expected-level thresholds reported beside the levels


@dataclass(frozen=True)
class CutRow:
    cut: str  # "level >= 4" or "score >= 3.5"
    kept: float  # share of all pairs at or above the cut
    precision: float | None  # of those, the share a person graded >= the level (None: none kept)
    recall: float  # of the pairs a person graded >= the level, the share kept
    base: float  # share of all pairs a person graded >= the level: the precision of keeping everything


def cut_row(name: str, kept_mask: Sequence[bool], human_ok: Sequence[bool]) -> CutRow:
    n = len(kept_mask)
    kept = sum(kept_mask)
    both = sum(k and h for k, h in zip(kept_mask, human_ok))
    relevant = sum(human_ok)
    return CutRow(
        name,
        kept / n if n else 0.0,
        both / kept if kept else None,
        both / relevant if relevant else 0.0,
        relevant / n if n else 0.0,
    )


def level_rows(pred: Sequence[int], human: Sequence[int], labels: Sequence[str]) -> list[CutRow]:
    """One row per level above the lowest: the cut `min_level = L` (levels as class indices)."""
    return [
        cut_row(f"level >= {labels[k]}", [p >= k for p in pred], [h >= k for h in human]) for k in range(1, len(labels))
    ]


def score_rows(
    scores: Sequence[float], human: Sequence[int], target: int, labels: Sequence[str], cuts: Sequence[float]
) -> list[CutRow]:
    """`min_score = s` on the expected level, each judged against "a person graded >= labels[target]"."""
    ok = [h >= target for h in human]
    return [cut_row(f"score >= {s:g}", [x >= s for x in scores], ok) for s in cuts]


def table(rows: Sequence[CutRow]) -> str:
    out = ["| cut-off | pairs kept | precision | recall | without a cut-off |", "|---|---|---|---|---|"]
    for r in rows:
        prec = "–" if r.precision is None else f"{r.precision:.1%}"
        out.append(f"| {r.cut} | {r.kept:.1%} | {prec} | {r.recall:.1%} | {r.base:.1%} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.train.cutoffs", description=__doc__.splitlines()[0])
    p.add_argument("data_file", help="CSV or JSON lines with query, title and a graded `level`")
    p.add_argument("--model", action="append", help="checkpoint or builtin:NAME (repeatable; default the default)")
    p.add_argument("--dtype", default="auto", help="as qtrel serve: auto = what the server would run")
    p.add_argument("--target", default="4", help="the human level the score cut-offs are judged against")
    a = p.parse_args(argv)

    from model.builtin import resolve_model
    from model.data import read_labelled
    from model.device import resolve_dtype
    from model.relevance import RelevanceModel
    from model.train.evaluate import score_dataset

    for spec in a.model or ["builtin:default"]:
        path = resolve_model(spec)
        model = RelevanceModel.load(path, dtype=resolve_dtype(a.dtype, "cpu"))
        labels = list(model.labels)
        ds = read_labelled(a.data_file, labels)
        scored = score_dataset(model, ds.examples, MAX_BATCH_TOKENS)
        pred, scores = scored.level.tolist(), scored.expected.tolist()
        print(f"\n### {model.name} ({spec}, {model.dtype}) on {a.data_file}: {len(ds.examples)} pairs\n")
        levels = table(level_rows(pred, ds.labels, labels))
        print(f"Levels: of the pairs graded >= L, the share a person graded >= L.\n\n{levels}")
        if a.target not in labels:
            p.error(f"--target {a.target!r} is not a level of {model.name}: its levels are {', '.join(labels)}")
        target = labels.index(a.target)
        rows = score_rows(scores, ds.labels, target, labels, SCORE_CUTS)
        print(f"\nScores (expected level), judged against a person's level >= {a.target}.\n\n{table(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
