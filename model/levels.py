"""The levels of a grade, without torch: the default 5-level scale, each level's numeric value, the
expected level on 0..1, one scored pair as plain numbers, and the one default batch budget. Imported by the
HTTP layer, the service and the settings, which need these numbers but not the network."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_LEVELS = ("1", "2", "3", "4", "5")  # 1 = unrelated ... 5 = fully satisfies the query
MAX_BATCH_TOKENS = 8192  # padded tokens per forward pass: the default of the server and every command
# Word pieces consecutive windows of a long title share by default (model.windows); named as the API names it:
# the service's chunk_overlap setting, qtrel score's --chunk-overlap
CHUNK_OVERLAP = 32
# The logit of a level no probability reaches (a one-logit head's levels between its lowest and its highest):
# float32's lowest, so softmax gives it exactly 0; never a score to show (raw_level_scores leaves it out).
NO_LOGIT = float.fromhex("-0x1.fffffep+127")


def level_numbers(labels: Sequence[str]) -> list[float]:
    """Numeric value of each level for the expected-level score: the label itself when numeric, else its
    1-based rank."""
    try:
        return [float(x) for x in labels]
    except ValueError:
        return [float(i) for i in range(1, len(labels) + 1)]


def unit_score(expected: float, labels: Sequence[str]) -> float:
    """The expected level mapped onto 0..1, (E - lo) / (hi - lo) over the levels' values: 1.0 is "surely
    the top level", 0.0 "surely the lowest"; it ranks exactly as the expected level (Cohere's
    `relevance_score`). 1.0 when the model has a single level value."""
    values = level_numbers(labels)
    lo, hi = min(values), max(values)
    if hi <= lo:
        return 1.0
    return min(1.0, max(0.0, (expected - lo) / (hi - lo)))


def raw_score(level_logits: Sequence[float]) -> float:
    """A pair's raw score (`raw_scores` on /score and /rerank): the top level's logit minus the lowest's. For a
    one-logit head (model.heads) that is its logit itself; for a k-level head, the log-odds of the top level
    against the lowest."""
    return float(level_logits[-1] - level_logits[0])


@dataclass
class PairScore:
    """One scored pair as plain numbers: a row of model.scoring.ScoredBatch. What RelevanceModel.predict answers
    per pair, what the worker hands the engine and what the score cache keeps. Beside it: the model's batch
    (ScoredBatch) and the service's answer (service.runtime.results.Scored); a batch crosses the model process's
    pipe as columns (BatchScores: four lists pickle at ~0.4x the cost of a row each) and bulk scoring writes a
    chunk's columns (model.bulk.io.Scores)."""

    logits: list[float]
    probs: list[float]  # per level, in the order of the model's labels
    level: int  # class index chosen by the model's level rule
    expected: float  # expected level: the ranking score


def raw_level_scores(level_logits: Sequence[float], labels: Sequence[str]) -> list[tuple[float, str]]:
    """Each level's raw logit with its label (TEI /predict with `raw_scores`), best first. A level with no logit
    of its own (NO_LOGIT: a calibrated one-logit head's middle levels) is left out: such a head answers its
    lowest level at 0 and its highest at its logit."""
    kept = [(float(v), lab) for v, lab in zip(level_logits, labels) if v > NO_LOGIT / 2]
    return sorted(kept, key=lambda p: -p[0])
