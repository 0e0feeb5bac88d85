"""The levels of a grade, without torch: the default 5-level scale, each level's numeric value, the
expected level on 0..1, the one default batch budget, and the two shapes of scored pairs: one pair as plain
numbers (`PairScore`), a batch as columns (`ScoredBatch`), and a pair packed as bytes (a row: `pack_row`). Imported
by the HTTP layer, the service and the settings, which need these numbers but not the network."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

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
    """One scored pair as plain numbers: a row of a ScoredBatch (`ScoredBatch.rows`). What RelevanceModel.predict
    answers per pair, what the worker hands the engine and what the score cache keeps."""

    logits: list[float]
    probs: list[float]  # per level, in the order of the model's labels
    level: int  # class index chosen by the model's level rule
    expected: float  # expected level: the ranking score


# A pair's row: its level as one byte (so that `row[0]` reads it without unpacking), then its logits,
# probabilities and expected level as little-endian float64s: exact for the float32s the model scores in and
# for any Python float, so a row unpacks to the very PairScore `ScoredBatch.rows` gives. A model process packs
# a batch's rows (`ScoredBatch.pack`); the engine keeps each pair's row as it is (its flight's result, its cache
# entry, its answer to a front process) and the HTTP side unpacks it (`unpack_row`, `unpack_rows`).
_ROWS: dict[int, tuple[struct.Struct, int]] = {}  # a row's length -> its format and the levels it holds


def _row_format(size: int) -> tuple[struct.Struct, int]:
    got = _ROWS.get(size)
    if got is None:
        k, odd = divmod(size - 9, 16)
        if odd or k < 1:
            raise ValueError(f"{size} bytes is no scored pair's row")
        got = _ROWS[size] = (struct.Struct(f"<B{2 * k + 1}d"), k)
    return got


def pack_row(o: PairScore) -> bytes:
    """One pair's row (see above)."""
    fmt, _ = _row_format(9 + 16 * len(o.logits))
    return fmt.pack(o.level, *o.logits, *o.probs, o.expected)


def unpack_row(row: bytes) -> PairScore:
    fmt, k = _row_format(len(row))
    v = fmt.unpack(row)
    return PairScore(list(v[1 : k + 1]), list(v[k + 1 : 2 * k + 1]), v[0], v[2 * k + 1])


def unpack_rows(rows: bytes, n: int) -> list[PairScore]:
    """`n` pairs' rows, joined."""
    if not n:
        return []
    fmt, k = _row_format(len(rows) // n)
    a, b, e = k + 1, 2 * k + 1, 2 * k + 1
    return [PairScore(list(v[1:a]), list(v[a:b]), v[0], v[e]) for v in fmt.iter_unpack(rows)]


def split_rows(rows: bytes, n: int) -> list[bytes]:
    """`n` pairs' rows, joined, as one `bytes` a pair."""
    if not n:
        return []
    size = len(rows) // n
    return [rows[i : i + size] for i in range(0, size * n, size)]


class Column(Protocol):
    """What a ScoredBatch's columns are: a torch tensor or a numpy array."""

    def tolist(self) -> Any: ...

    def __len__(self) -> int: ...


C = TypeVar("C", bound=Column)
D = TypeVar("D", bound=Column)


@dataclass
class ScoredBatch(Generic[C]):
    """Scored pairs as columns, rows in input order: float32 (level int64). The model scores into torch
    tensors (`model.scoring.score_logits`); bulk scoring reads and writes it as numpy arrays (`map`); a batch
    crosses the model process's pipe as its packed rows (`pack`: one `bytes`, which the server unpickles at no
    cost a pair and keeps a slice of a pair). In bulk scoring a bad row has NaN scores and level -1."""

    logits: C  # (B, k)
    probs: C  # (B, k), per level in the order of the model's labels
    expected: C  # (B,) expected level, the ranking score
    level: C  # (B,) class index chosen by the level rule
    # (B, 4), where titles were scored in windows (model.windows): the best window's index, the windows
    # scored, and the window's character span in the title (start, end)
    window: C | None = None

    def __len__(self) -> int:
        return len(self.level)

    def __reduce__(self) -> tuple[Any, ...]:  # as its class and columns: cheaper than a dataclass's default
        return type(self), (self.logits, self.probs, self.expected, self.level, self.window)

    def map(self, f: Callable[[C], D]) -> ScoredBatch[D]:
        """The same batch with `f` applied to each column (e.g. torch tensors to numpy arrays)."""
        window = None if self.window is None else f(self.window)
        return ScoredBatch(f(self.logits), f(self.probs), f(self.expected), f(self.level), window)

    def pack(self) -> bytes:
        """The batch's rows, joined (see `pack_row`): what a model process sends for a batch."""
        import numpy as np  # the columns are numpy arrays (or tensors, which numpy reads)

        logits = np.asarray(self.logits)
        k = logits.shape[1]
        if k > 255:
            raise ValueError(f"{k} levels: a row holds at most 255")
        rows = np.empty(len(self), np.dtype([("level", "u1"), ("scores", "<f8", (2 * k + 1,))]))
        rows["level"] = self.level
        scores = rows["scores"]
        scores[:, :k] = logits
        scores[:, k : 2 * k] = self.probs
        scores[:, 2 * k] = self.expected
        return rows.tobytes()

    def rows(self) -> list[PairScore]:
        """One PairScore per row, as plain Python numbers."""
        cols = (self.logits, self.probs, self.level, self.expected)
        return list(map(PairScore, *(c.tolist() for c in cols)))


def raw_level_scores(level_logits: Sequence[float], labels: Sequence[str]) -> list[tuple[float, str]]:
    """Each level's raw logit with its label (TEI /predict with `raw_scores`), best first. A level with no logit
    of its own (NO_LOGIT: a calibrated one-logit head's middle levels) is left out: such a head answers its
    lowest level at 0 and its highest at its logit."""
    kept = [(float(v), lab) for v, lab in zip(level_logits, labels) if v > NO_LOGIT / 2]
    return sorted(kept, key=lambda p: -p[0])
