"""What the engine returns and raises beside the runtime's own errors: scored pairs, tokenised pairs,
a too-long input, a failed forward. Plain data, no HTTP (service.http.errors maps the errors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from model.levels import PairScore
from model.tokenizer import EncodedPairs, PairCut
from service.runtime.workers.backend import BackendError


@dataclass
class Scored:
    outputs: list[PairScore]
    lengths: list[int]  # per pair, its tokens (special tokens included)
    truncated: list[bool]  # per pair, whether truncation cut it
    labels: list[str]  # the model's levels, in class order
    model: str  # the model's name


@dataclass
class Tokenized:
    """Pairs as the model sees them, and what was cut (`/tokenize`): no forward pass."""

    enc: EncodedPairs
    tokens: list[list[str]]  # per pair, the text of each id
    cuts: list[PairCut]  # per pair, what truncation kept and cut (ids)
    pieces: Callable[[Sequence[int]], list[str]]  # ids -> their word-piece texts
    max_length: int
    model: str


class InputTooLong(ValueError):
    """A pair longer than the model's window, where the caller asked for no truncation."""

    def __init__(self, index: int, max_length: int):
        super().__init__(f"input {index} is longer than the model's {max_length} tokens; set truncate=true")


class InferenceFailed(BackendError):
    """The forward pass (or an explanation) failed; only the requests of that batch fail."""
