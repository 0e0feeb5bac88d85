"""What the engine returns and raises beside the runtime's own errors: scored pairs, tokenised pairs,
a too-long input, a failed forward. Plain data, no HTTP (service.http.errors maps the errors)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from model.levels import PairScore, pack_row, unpack_rows
from model.tokenizer import EncodedPairs, PairCut
from service.runtime.workers.backend import BackendError


@dataclass(frozen=True, slots=True)
class WindowPick:
    """Which window of a document won, and where it lies in the document."""

    index: int  # 0-based, in document order
    count: int  # windows the document was scored in (1: it fitted)
    start: int  # the window's character span in the document: document[start:end]
    end: int


@dataclass
class Scored:
    """The engine's answer: per pair its scores and what the tokenizer saw, and which model scored them. Scored
    in windows (`Engine.score_windows`), a row is a document and holds its best window's."""

    outputs: list[PairScore]
    lengths: list[int]  # per pair, its tokens (special tokens included)
    truncated: list[bool]  # per pair, whether truncation cut it
    labels: list[str]  # the model's levels, in class order
    model: str  # the model's name
    unknown: list[float]  # per pair, the share of its text the model cannot read (EncodedPairs.unknown)
    picks: list[WindowPick] | None = None  # scored in windows: per document, the window whose scores it got
    window_tokens: int = 0  # scored in windows: the tokens of every window

    @property
    def tokens(self) -> int:
        """The tokens the request cost: with windows, every window's."""
        return self.window_tokens if self.picks is not None else sum(self.lengths)


# A request's answer as the engine core sends it to a front process: its pairs' rows joined (model.levels.pack_row,
# as the model processes packed them: the core unpacks no score), their lengths and truncation flags, the model's
# levels and its name. service.runtime.scoring builds it; the front rebuilds the Scored (`scored_of`).
Rows = tuple[bytes, list[int], list[bool], list[str], str]


def rows_of(s: Scored) -> Rows:
    return (b"".join(map(pack_row, s.outputs)), s.lengths, s.truncated, s.labels, s.model)


def scored_of(rows: Rows, unknown: list[float]) -> Scored:
    packed, lengths, truncated, labels, model = rows
    return Scored(unpack_rows(packed, len(lengths)), lengths, truncated, labels, model, unknown)


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


class Unreadable(ValueError):
    """A pair whose share of unknown tokens is over the limit the caller set (unknown_share_refuse)."""

    def __init__(self, index: int, share: float, limit: float):
        super().__init__(
            f"pair {index}: {share:.0%} of its tokens are unknown to the model (unknown_share_refuse {limit}); "
            "it cannot read this text: choose a model for its language (GET /v1/models)"
        )


def check_readable(unknown: list[float], limit: float | None) -> None:
    """Refuse (Unreadable) the first pair whose unknown share is over `limit` (None: no limit)."""
    if limit is not None and (i := next((i for i, x in enumerate(unknown) if x > limit), None)) is not None:
        raise Unreadable(i, unknown[i], limit)


class InferenceFailed(BackendError):
    """The forward pass (or an explanation) failed; only the requests of that batch fail."""
