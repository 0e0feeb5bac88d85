"""The one definition of a score: logits -> probabilities, expected level and the returned level.

Every consumer (`/score`, `/predict`, `/rerank`, `/explain`, `qtrel eval`, training's dev report) goes
through `score_logits`, so the level rule lives here and nowhere else.

The level rule: with no cut points, the most probable level (argmax). With cut points c_1 < ... < c_{k-1}
on the expected level E = sum_k value_k * p(k), the level is the number of cut points E has reached:
E < c_1 -> the first level, c_1 <= E < c_2 -> the second, ... Cut points are fitted on held-out data for
quadratic weighted kappa (`fit_cuts`) and stored in the checkpoint's config (`qtrel_level_cuts`). Unlike
argmax, this rule is monotone in E and uses the whole scale when the training prior is skewed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from model.levels import ScoredBatch, level_numbers

CONFIG_KEY = "qtrel_level_cuts"


def level_values(labels: Sequence[str]) -> Tensor:
    """Numeric value of each level for the expected-level score (model.levels.level_numbers)."""
    return torch.tensor(level_numbers(labels), dtype=torch.float32)


@dataclass(frozen=True)
class LevelRule:
    """How the returned level is chosen; `cuts` None means argmax."""

    cuts: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.cuts is not None and any(b <= a for a, b in zip(self.cuts, self.cuts[1:])):
            raise ValueError(f"level cut points must increase strictly, got {list(self.cuts)}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any], num_levels: int) -> LevelRule:
        """The rule stored in a config's extra keys; checks there are num_levels - 1 cut points."""
        raw = extra.get(CONFIG_KEY)
        if raw is None:
            return cls()
        cuts = tuple(float(x) for x in raw)
        if len(cuts) != num_levels - 1:
            raise ValueError(f"{CONFIG_KEY} has {len(cuts)} cut points; {num_levels} levels need {num_levels - 1}")
        return cls(cuts)

    def to_extra(self) -> dict[str, Any]:
        return {CONFIG_KEY: None if self.cuts is None else [round(c, 6) for c in self.cuts]}

    @property
    def name(self) -> str:
        return "argmax" if self.cuts is None else "expected-level cut points"

    def levels(self, probs: Tensor, expected: Tensor) -> Tensor:
        """(B,) int64 class index per row of (B, k) probabilities with (B,) expected levels."""
        if self.cuts is None:
            return probs.argmax(-1)
        return torch.bucketize(expected, torch.tensor(self.cuts, dtype=expected.dtype), right=True)


def merge_classes(logits: Tensor, class_levels: Sequence[int]) -> Tensor:
    """(B, classes) logits -> (B, levels) log-probabilities, each level's classes' probabilities summed: a
    head with extra classes (model.config) scores as a head over its levels. Softmax of the result gives
    the levels' probabilities, so everything downstream treats it as logits."""
    n = max(class_levels) + 1
    if len(class_levels) == n:
        return logits
    logp = logits.float().log_softmax(-1)
    out = logp[:, :n].clone()
    for c in range(n, len(class_levels)):
        lv = class_levels[c]
        out[:, lv] = torch.logaddexp(out[:, lv], logp[:, c])
    return out


def score_logits(logits: Tensor, values: Tensor, rule: LevelRule) -> ScoredBatch[Tensor]:
    """(B, k) logits -> the scored batch (model.levels.ScoredBatch), float32 on cpu."""
    logits = logits.float()
    probs = logits.softmax(-1)
    # Column by column, in one order: a pair's score is the same bits in any batch (a matrix-vector product
    # adds in an order that depends on the batch's size), so that a score job matches `qtrel score` exactly
    v = values.to(probs.dtype)
    expected = probs[..., 0] * v[0]
    for k in range(1, probs.shape[-1]):
        expected = expected + probs[..., k] * v[k]
    return ScoredBatch(logits, probs, expected, rule.levels(probs, expected))


def fit_cuts(
    expected: Sequence[float],
    y_true: Sequence[int],
    k: int,
    min_share: float = 0.0,
    rounds: int = 4,
    fixed: dict[int, float] | None = None,
) -> tuple[float, ...]:
    """Cut points on the expected level (values 1..k) maximising quadratic weighted kappa against the
    true class indices, with every level given to at least `min_share` of the pairs: start at the cut
    points that reproduce the true level shares, then coordinate ascent, each cut point searched over
    quantiles of the observed values between its neighbours. Deterministic; ties keep the earlier cut.
    `fixed` pins cut points by index (e.g. the first, set from how unrelated titles score); the others
    are fitted around them."""
    fixed = dict(fixed or {})
    e = torch.tensor(expected, dtype=torch.float64)
    order = torch.sort(e).values

    y = torch.tensor(y_true, dtype=torch.long)
    w = (torch.arange(k).view(-1, 1) - torch.arange(k).view(1, -1)).double().pow(2) / (k - 1) ** 2
    row = torch.bincount(y, minlength=k).double()

    def qwk(c: list[float]) -> float:  # model.train.metrics.quadratic_kappa, vectorised for the search
        pred = torch.bucketize(e, torch.tensor(c, dtype=torch.float64), right=True)
        m = torch.bincount(y * k + pred, minlength=k * k).double().view(k, k)
        if min_share and (m.sum(0) < min_share * len(y)).any():
            return -1.0
        expected_m = row.view(-1, 1) * m.sum(0).view(1, -1) / len(y)
        den = (w * expected_m).sum().item()
        return 1.0 - (w * m).sum().item() / den if den else 1.0

    # Start where each level is given to as many pairs as carry it in the truth (feasible for min_share
    # whenever the truth is), then improve one cut point at a time.
    cum = torch.cumsum(row, 0)[:-1] / len(y)
    cuts = torch.quantile(order, cum.clamp(0, 1)).tolist()
    for j, v in fixed.items():
        cuts[j] = v
    for j in range(1, len(cuts)):  # ties in the scores: keep the cuts strictly increasing, at 1e-5 (stored to 1e-6)
        if j not in fixed:
            cuts[j] = max(cuts[j], cuts[j - 1] + 1e-5)
    for j in range(len(cuts) - 2, -1, -1):  # and below a pinned one
        if j not in fixed:
            cuts[j] = min(cuts[j], cuts[j + 1] - 1e-5)
    best = qwk(cuts)
    # Candidate thresholds: 401 quantiles of the observed scores (plenty, and fast).
    grid = torch.quantile(order, torch.linspace(0, 1, 401, dtype=torch.float64)).unique().tolist()
    for _ in range(rounds):
        improved = False
        for j in range(k - 1):
            if j in fixed:
                continue
            lo = cuts[j - 1] if j else -float("inf")
            hi = cuts[j + 1] if j + 1 < k - 1 else float("inf")
            for g in grid:
                if not lo < g < hi or g == cuts[j]:
                    continue
                trial = cuts[:j] + [g] + cuts[j + 1 :]
                v = qwk(trial)
                if v > best + 1e-12:
                    best, cuts, improved = v, trial, True
        if not improved:
            break
    return tuple(cuts)
