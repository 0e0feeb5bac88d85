"""Bulk scoring of a file on one machine: `qtrel score INPUT --out OUTPUT`.

The input (CSV, JSON lines or Parquet, `model.bulk.io`) is read in chunks of `chunk_rows` rows, so memory
stays bounded whatever the file's size. Each chunk is tokenised at once, forwarded in length-sorted batches
of at most `max_batch_tokens` padded tokens (`RelevanceModel.encoded_logits`), scored by the model's one
scoring contract (`model.scoring`), and appended to the output in input order. The output has the input's
columns and, after them, `level` (the label chosen by the checkpoint's level rule), `score` (the expected
level) and `p_<label>` per level, each optionally prefixed.

Bad rows (a missing or empty query or title, a CSV row with the wrong number of fields, a JSON line that
is not an object) stop the run at the chunk that holds them, with every bad row of that chunk listed as
file:line (`model.data.DataError`); the chunks before it are written, so that after fixing the file
`resume=True` goes on from there. With `skip_bad=True` they are written with empty score columns instead
and counted in the summary.

`resume=True` keeps the rows OUTPUT already holds, cut back to the last complete chunk, and scores the
rest: with the same model and `chunk_rows` the result is byte for byte the file an uninterrupted run writes.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from model.bulk.io import (
    Chunk,
    CsvSink,
    CsvSource,
    JsonlSink,
    JsonlSource,
    Sink,
    Source,
    format_of,
    parts_dir,
    score_columns,
)
from model.bulk.parquet import ParquetSink, ParquetSource
from model.data import DataError
from model.levels import MAX_BATCH_TOKENS, ScoredBatch
from model.tokenizer import PairTokenizer, Truncation
from model.windows import CHUNK_OVERLAP, best, split_pairs

if TYPE_CHECKING:  # the scoring server runs score_rows without torch in its own process
    from model.relevance import RelevanceModel

__all__ = [
    "Forward",
    "ScoreOptions",
    "Scorer",
    "model_forward",
    "run_file",
    "score_file",
    "score_names",
    "score_pairs",
    "score_rows",
]

log = logging.getLogger("qtrel.bulk")

SOURCES: dict[str, Callable[[Path, str, str], Source]] = {
    "csv": CsvSource,
    "jsonl": JsonlSource,
    "parquet": ParquetSource,
}
SINKS: dict[str, Callable[..., Sink]] = {"csv": CsvSink, "jsonl": JsonlSink, "parquet": ParquetSink}


@dataclass(frozen=True)
class ScoreOptions:
    """What every bulk scorer takes alike, on one machine or on Ray: the pair's columns, the prefix of
    the score columns, the batch budget, and what to do with bad rows and with an existing output."""

    query_column: str = "query"
    title_column: str = "title"
    prefix: str = ""
    max_batch_tokens: int = MAX_BATCH_TOKENS
    skip_bad: bool = False  # write bad rows with empty scores instead of stopping at their chunk
    overwrite: bool = False  # replace an existing output
    max_chunks: int | None = None  # score each long title in at most this many windows (model.windows)
    chunk_overlap: int = CHUNK_OVERLAP  # word pieces consecutive windows share

    def __post_init__(self) -> None:
        if self.max_chunks is not None and self.max_chunks < 1:
            raise ValueError(f"max_chunks must be at least 1, got {self.max_chunks}")
        if self.chunk_overlap < 0:
            raise ValueError(f"chunk_overlap must be at least 0, got {self.chunk_overlap}")


# With windows: the winning window (0-based), the windows scored, the window's character span in the title
WINDOW_COLUMNS = ("window", "windows", "window_start", "window_end")


def score_names(labels: Sequence[str], prefix: str = "", windows: bool = False) -> list[str]:
    """Names of the score columns: level, score, p_<label> for each level, then with windows WINDOW_COLUMNS."""
    names = [f"{prefix}level", f"{prefix}score", *(f"{prefix}p_{lab}" for lab in labels)]
    return names + [f"{prefix}{c}" for c in WINDOW_COLUMNS] if windows else names


# Distinct pairs -> their scores as numpy columns: the model's one scoring contract (model.scoring), run here
# (`model_forward`) or by a scoring server (service.jobs).
Forward = Callable[[list[tuple[str, str]]], ScoredBatch[np.ndarray]]


class Scorer(Protocol):
    """What `run_file` needs: the score columns' levels, the scores of a chunk's pairs (None: a bad row), and
    how many pairs it has sent to the model so far (each distinct pair of a chunk once; with windows, each
    distinct window)."""

    @property
    def labels(self) -> Sequence[str]: ...

    @property
    def forwarded(self) -> int: ...

    def __call__(self, pairs: Sequence[tuple[str, str] | None]) -> ScoredBatch[np.ndarray]: ...


def model_forward(
    model: RelevanceModel, max_batch_tokens: int = MAX_BATCH_TOKENS, truncation: Truncation = "only_second"
) -> Forward:
    """`Forward` on a model loaded here: length-sorted batches of at most `max_batch_tokens` padded tokens."""

    def forward(todo: list[tuple[str, str]]) -> ScoredBatch[np.ndarray]:
        enc = model.encode(todo, truncation)
        return model.score(model.encoded_logits(enc, max_batch_tokens)).map(lambda c: c.numpy())

    return forward


def score_pairs(
    model: RelevanceModel,
    pairs: Sequence[tuple[str, str] | None],
    max_batch_tokens: int = MAX_BATCH_TOKENS,
    max_chunks: int | None = None,
    chunk_overlap: int = CHUNK_OVERLAP,
) -> ScoredBatch[np.ndarray]:
    """Scores of pairs in their order, forwarded here in length-sorted batches (`score_rows`)."""
    forward = model_forward(model, max_batch_tokens)
    return score_rows(model.labels, model.tokenizer, pairs, forward, max_chunks, chunk_overlap)


def score_rows(
    labels: Sequence[str],
    tokenizer: PairTokenizer,
    pairs: Sequence[tuple[str, str] | None],
    forward: Forward,
    max_chunks: int | None = None,
    chunk_overlap: int = CHUNK_OVERLAP,
) -> ScoredBatch[np.ndarray]:
    """Scores of pairs in their order; a None row gets NaN scores and level -1. Each distinct pair goes to
    `forward` once and its row is copied to its duplicates (the same numbers, bit for bit: search logs repeat
    their popular pairs). With `max_chunks`, a title longer than the model's window is scored in at most that
    many windows (`model.windows.split_pairs`, as the service's `max_chunks`) and gets its best window's
    scores and `window` (WINDOW_COLUMNS)."""
    n, k = len(pairs), len(labels)
    out: ScoredBatch[np.ndarray] = ScoredBatch(
        np.full((n, k), np.nan, dtype=np.float32),
        np.full((n, k), np.nan, dtype=np.float32),
        np.full(n, np.nan, dtype=np.float32),
        np.full(n, -1, dtype=np.int64),
        np.full((n, len(WINDOW_COLUMNS)), np.nan, dtype=np.float32) if max_chunks is not None else None,
    )
    present = [(i, p) for i, p in enumerate(pairs) if p is not None]
    if not present:
        return out
    good = [i for i, _ in present]
    distinct: dict[tuple[str, str], int] = {}
    rows = [distinct.setdefault(p, len(distinct)) for _, p in present]  # per good row, its distinct pair
    todo = list(distinct)
    if max_chunks is not None:
        docs = split_pairs(tokenizer, [q for q, _ in todo], [t for _, t in todo], max_chunks, chunk_overlap)
        windows: dict[tuple[str, str], int] = {}  # the distinct windows, forwarded once each
        at = [[windows.setdefault((q, w.text), len(windows)) for w in ws] for (q, _), ws in zip(todo, docs)]
        todo = list(windows)
    got = forward(todo)
    if out.window is not None:
        pick = [best(got.expected[r].tolist()) for r in at]
        won = [r[j] for r, j in zip(at, pick)]  # per distinct pair, its best window
        got = got.map(lambda c: c[won])
        spans = [[j, len(ws), ws[j].start, ws[j].end] for j, ws in zip(pick, docs)]
        out.window[good] = np.array(spans, dtype=np.float32)[rows]
    out.logits[good], out.probs[good] = got.logits[rows], got.probs[rows]
    out.expected[good], out.level[good] = got.expected[rows], got.level[rows]
    return out


def _bad_rows(path: Path, chunk: Chunk, max_errors: int) -> DataError:
    shown = chunk.problems[:max_errors]
    more = f" (the first {max_errors} shown)" if len(chunk.problems) > max_errors else ""
    return DataError(
        f"{len(chunk.problems)} bad row(s) in {path} among rows {chunk.start + 1}-{chunk.start + len(chunk)}{more}; "
        f"the {chunk.start} rows before them are written. Fix them and resume, or pass --skip-bad to write them "
        "with empty scores:\n" + "\n".join(f"{path}:{line}: {why}" for line, why in shown)
    )


class _Progress:
    """A tqdm bar in pairs with pairs/s where tqdm is installed, else one log line per chunk."""

    def __init__(self, on: bool, total: int | None, initial: int):
        self.bar = None
        self.t0, self.done = time.perf_counter(), 0
        if on:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(total=total, initial=initial, unit=" pairs", smoothing=0.1)
        self.on, self.initial = on, initial

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.on:
            log.info("%d rows written (%d this run) at %.0f pairs/s", self.initial + self.done, self.done, self.rate)

    @property
    def rate(self) -> float:
        return self.done / max(time.perf_counter() - self.t0, 1e-9)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _LocalScorer:
    """`score_rows` on a model loaded here, with the options' batch budget and windows."""

    def __init__(self, model: RelevanceModel, o: ScoreOptions, truncation: Truncation = "only_second"):
        self.model, self.o = model, o
        self.labels: Sequence[str] = model.labels
        self.forwarded = 0
        self._forward = model_forward(model, o.max_batch_tokens, truncation)

    def __call__(self, pairs: Sequence[tuple[str, str] | None]) -> ScoredBatch[np.ndarray]:
        return score_rows(
            self.labels, self.model.tokenizer, pairs, self.forward, self.o.max_chunks, self.o.chunk_overlap
        )

    def forward(self, todo: list[tuple[str, str]]) -> ScoredBatch[np.ndarray]:
        self.forwarded += len(todo)
        return self._forward(todo)


def score_file(
    model: RelevanceModel,
    input: str | Path,
    output: str | Path,
    options: ScoreOptions | None = None,
    *,
    chunk_rows: int = 20000,
    resume: bool = False,
    progress: bool = True,
    max_errors: int = 20,
    truncation: Truncation = "only_second",
    on_chunk: Callable[[int, int], None] | None = None,
) -> dict:
    """Score every query-title pair of INPUT into OUTPUT (same format); see the module doc. OUTPUT must not
    exist unless `resume` (go on from what it holds) or `overwrite`. Returns a summary: rows in OUTPUT,
    rows scored and bad rows in this run, rows kept from before, seconds and pairs/s. `truncation` and
    `on_chunk`: as a scoring server's job asks (service.runtime.workers.driver runs a job with this)."""
    o = options or ScoreOptions()
    return run_file(
        _LocalScorer(model, o, truncation),
        input,
        output,
        o,
        chunk_rows=chunk_rows,
        resume=resume,
        progress=progress,
        max_errors=max_errors,
        on_chunk=on_chunk,
    )


def run_file(
    scorer: Scorer,
    input: str | Path,
    output: str | Path,
    options: ScoreOptions | None = None,
    *,
    chunk_rows: int = 20000,
    resume: bool = False,
    progress: bool = True,
    max_errors: int = 20,
    on_chunk: Callable[[int, int], None] | None = None,
) -> dict:
    """`score_file` with any Scorer (a scoring server's: service.jobs); `on_chunk(rows, bad)` after each chunk
    is written and synced, with the rows OUTPUT then holds and the chunk's bad rows (written without scores)."""
    input, output = Path(input), Path(output)
    kind = format_of(input)
    if format_of(output) != kind:
        raise ValueError(f"{output}: the output has the input's format ({kind}); give it the suffix of {input.name}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    if input.resolve() == output.resolve():
        raise ValueError(f"{output}: the output cannot be the input")
    if not input.is_file():
        raise DataError(f"{input}: no such file")
    exists = output.exists() or parts_dir(output).exists()
    o = options or ScoreOptions()
    if exists and not (resume or o.overwrite):
        raise ValueError(f"{output} exists: pass --resume to go on from the rows it holds, or --overwrite")
    if exists and o.overwrite and not resume:
        output.unlink(missing_ok=True)
        shutil.rmtree(parts_dir(output), ignore_errors=True)
    source = SOURCES[kind](input, o.query_column, o.title_column)
    names = score_names(scorer.labels, o.prefix, o.max_chunks is not None)
    sink = SINKS[kind](output, source, names, resume, chunk_rows)
    kept = sink.rows_done
    if kept:
        log.info("%s holds %d complete rows (to the last whole chunk): going on from row %d", output, kept, kept + 1)
    bar = _Progress(progress, source.total, kept)
    t0, scored, bad, sent = time.perf_counter(), 0, 0, scorer.forwarded
    try:
        for chunk in source.chunks(chunk_rows, skip=kept):
            if chunk.problems and not o.skip_bad:
                raise _bad_rows(input, chunk, max_errors)
            sink.write(chunk, *score_columns(scorer(chunk.pairs), scorer.labels))
            if on_chunk is not None:
                on_chunk(sink.rows_done, len(chunk.problems))
            scored += len(chunk) - len(chunk.problems)
            bad += len(chunk.problems)
            if chunk.problems:
                log.warning(
                    "%d bad row(s) written with empty scores, first %s:%d: %s",
                    len(chunk.problems),
                    input,
                    *chunk.problems[0],
                )
            bar.update(len(chunk))
        sink.finish()  # Parquet joins its parts here: after an error they stay for a resume
    finally:
        bar.close()
        sink.close()
    seconds = time.perf_counter() - t0
    return {
        "input": str(input),
        "output": str(output),
        "rows": sink.rows_done,
        "scored": scored,
        "bad": bad,
        "kept": kept,
        "forwarded": scorer.forwarded - sent,  # distinct pairs of each chunk: the duplicates were copied, not scored
        "seconds": round(seconds, 3),
        "pairs_per_s": round((scored + bad) / max(seconds, 1e-9), 1),
    }
