"""Per-pair teacher targets for `qtrel train --teacher FILE` (distillation of a stronger scorer).

The file (CSV or JSON lines) has `query`, `title` and either or both of: `relevance`, the teacher's
estimate on the training file's relevance scale (Home Depot's 1..3, mapped onto the level values as
`loop.mse_targets` maps the raters' mean), and `p_<level>` for every level, the teacher's distribution.
Pairs are matched on (query, title) exactly; a judged pair the file lacks, and every sampled negative,
keeps its plain targets. On a matched pair, with weight w (`--teacher-weight`):

- cross-entropy's target is (1 - w) * one-hot(level) + w * teacher distribution;
- the ordinal term's target (with `--mse-weight`) is (1 - w) * its own target + w * the teacher's relevance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from model.data import DataError, Dataset, records


@dataclass(frozen=True)
class TeacherRow:
    relevance: float | None  # on the relevance scale of the training file (1..3)
    probs: tuple[float, ...] | None  # one per level, in class order, summing to 1


def read_teacher(path: str | Path, levels: list[str]) -> dict[tuple[str, str], TeacherRow]:
    """(query, title) -> the teacher's targets; every bad row is reported, as `model.data.read_labelled`."""
    path = Path(path)
    out: dict[tuple[str, str], TeacherRow] = {}
    errors: list[str] = []
    for n, row in records(path):
        if isinstance(row, Exception):
            errors.append(f"{path}:{n}: {row}")
            continue
        try:
            key = (str(row["query"]), str(row["title"]))
            rel = row.get("relevance")
            relevance = None if rel in (None, "") else float(rel)
            cols = [row.get(f"p_{lv}") for lv in levels]
            probs = None
            if any(c not in (None, "") for c in cols):
                probs = tuple(float(c) for c in cols)  # a missing one is a bad row (float(None) fails)
                if min(probs) < 0 or abs(math.fsum(probs) - 1) > 1e-3:
                    raise ValueError(f"p_{'/p_'.join(levels)} must be >= 0 and sum to 1, not {sum(probs):.4f}")
            if relevance is None and probs is None or (relevance is not None and not math.isfinite(relevance)):
                raise ValueError("needs a finite relevance or p_<level> for every level")
        except (KeyError, TypeError, ValueError) as e:
            errors.append(f"{path}:{n}: {e}")
            continue
        out[key] = TeacherRow(relevance, probs)
    if errors:
        raise DataError(f"{len(errors)} bad teacher rows:\n" + "\n".join(errors[:20]))
    if not out:
        raise DataError(f"{path}: no teacher rows")
    return out


def teacher_targets(
    ds: Dataset,
    teacher: dict[tuple[str, str], TeacherRow],
    values: Tensor,
    weight: float,
    base: Tensor | None,
) -> tuple[Tensor, Tensor, int]:
    """Per pair of `ds`: the cross-entropy target distribution (n, levels), the ordinal term's target (n,)
    (from `base`, or the level's value where None) and the number of pairs the teacher matched."""
    labels = torch.tensor(ds.labels)
    soft = torch.nn.functional.one_hot(labels, len(values)).float()
    target = values[labels].float().clone() if base is None else base.float().clone()
    lo, hi = values.min().item(), values.max().item()
    matched = 0
    for i, e in enumerate(ds.examples):
        row = teacher.get((e.query, e.title))
        if row is None:
            continue
        matched += 1
        if row.probs is not None:
            soft[i] = (1 - weight) * soft[i] + weight * torch.tensor(row.probs)
        if row.relevance is not None:
            target[i] = (1 - weight) * target[i] + weight * (lo + (row.relevance - 1) / 2 * (hi - lo))
    return soft, target, matched
