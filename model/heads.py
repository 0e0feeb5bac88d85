"""What a checkpoint's classifier outputs mean, read once at load: the levels a score grades and the
per-level logits that model.scoring turns into probabilities, the expected level and the level.

- A k-level head (k >= 2 classes, the default 5 levels, QBQTC's 3): one class per level, extra classes
  merged into theirs (model.scoring.merge_classes).
- A one-logit head (num_labels = 1: the ms-marco and bge rerankers): the logit z says "relevant" with
  probability sigmoid(z). It grades the levels "0" and "1" (probabilities 1 - sigmoid(z) and sigmoid(z),
  so the expected level, the score, is sigmoid(z) on 0..1), or, once `qtrel calibrate` has fitted cut
  points on labelled pairs, the levels it names in `qtrel_levels` (config.json): the probability sits on
  the lowest and the highest level, the expected level is lo + (hi - lo) * sigmoid(z), and the cut points
  (`qtrel_level_cuts`) choose the level. The raw logit is always the top level's minus the lowest's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model.config import BertConfig, ConfigError
from model.levels import NO_LOGIT
from model.scoring import merge_classes

LEVELS_KEY = "qtrel_levels"  # a one-logit head's levels, in order, lowest first (written by qtrel calibrate)
BINARY = ("0", "1")  # a one-logit head's levels without calibration: not relevant, relevant


@dataclass(frozen=True)
class Head:
    kind: str  # "levels" (one class per level) or "logit" (one logit)
    levels: tuple[str, ...]  # what a score grades, lowest first
    class_levels: tuple[int, ...]  # each class's level index ("levels" heads)

    @classmethod
    def of(cls, cfg: BertConfig) -> Head:
        if cfg.num_labels > 1:
            if cfg.extra.get(LEVELS_KEY) is not None:
                raise ConfigError(f"{LEVELS_KEY} is for one-logit heads; this head's levels are its id2label")
            return cls("levels", tuple(cfg.levels), tuple(cfg.class_levels))
        levels = tuple(str(x) for x in cfg.extra.get(LEVELS_KEY) or BINARY)
        if len(levels) < 2 or len(set(levels)) != len(levels):
            raise ConfigError(f"{LEVELS_KEY} must name at least two distinct levels, got {list(levels)}")
        return cls("logit", levels, (0,))

    @property
    def classes(self) -> int:
        return len(self.class_levels)

    def level_logits(self, logits: Tensor) -> Tensor:
        """(B, classes) head outputs -> (B, levels) logits whose softmax is each level's probability."""
        if self.kind == "levels":
            return merge_classes(logits, list(self.class_levels))
        z = logits.float()[:, :1]
        out = torch.full((len(z), len(self.levels)), NO_LOGIT, device=z.device)  # no mass between the ends
        out[:, :1] = 0.0
        out[:, -1:] = z
        return out


def levels_of(labels: Sequence[str]) -> dict[str, object]:
    """The config keys that give a one-logit head these levels."""
    return {LEVELS_KEY: [str(x) for x in labels]}
