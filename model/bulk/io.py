"""Bulk-scoring files, read and written chunk by chunk: CSV, JSON lines and Parquet (pyarrow, optional).

The format follows the suffix (`.csv`; `.jsonl` or `.json` for JSON lines; `.parquet`), and the output has
the input's format. A `Source` yields the input in chunks of rows, in order, each row with where it is
(file line; Parquet: row number) and its query-title pair, or why it cannot be scored. A `Sink` appends a
chunk with its score columns so that a crash can never leave a torn row behind a completed chunk:

- CSV and JSON lines are appended to OUTPUT, one write and one fsync per chunk. On a restart the rows
  already there are counted (a row is complete when it ends in a newline and has every column), and the
  file is cut back to the last chunk boundary, so that the resumed run forms the same batches again.
- Parquet cannot be appended to: each chunk becomes a part file in `OUTPUT.parts/` (written, then
  renamed), and the parts are joined into OUTPUT at the end. A restart counts the complete parts.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from model.data import DataError
from model.levels import ScoredBatch

FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}  # Parquet: model.bulk.parquet


@dataclass
class Chunk:
    start: int  # index of its first data row in the input, from 0
    lines: list[int]  # where each row is, for reports: file line (CSV, JSON lines) or row number (Parquet)
    pairs: list[tuple[str, str] | None]  # None: a bad row
    problems: list[tuple[int, str]]  # (line, why) of each bad row
    rows: Any  # the rows as read, for the sink: list of lists (CSV), of dicts (JSON lines), a pyarrow Table

    def __len__(self) -> int:
        return len(self.lines)


class Source(Protocol):
    @property
    def columns(self) -> list[str] | None: ...  # None: JSON lines, whose rows may each have other keys

    @property
    def total(self) -> int | None: ...  # rows, where the format tells without reading them (Parquet)

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]: ...


class Sink(Protocol):
    rows_done: int  # rows in the output, complete

    def write(self, chunk: Chunk, level: list[str | None], values: np.ndarray) -> None: ...  # (score_columns)

    def finish(self) -> None: ...  # after the last chunk

    def close(self) -> None: ...  # always, also after an error


def score_columns(scored: ScoredBatch[np.ndarray], labels: Sequence[str]) -> tuple[list[str | None], np.ndarray]:
    """A chunk's score columns: per row its level's label (None: a bad row), and its values (n, 1 + levels
    [+ 4]) float32: the expected level, one probability per level, then the window columns if scored in
    windows."""
    level = [labels[k] if k >= 0 else None for k in scored.level.tolist()]
    window = [] if scored.window is None else [scored.window]
    return level, np.concatenate([scored.expected[:, None], scored.probs, *window], axis=1)


def format_of(path: Path) -> str:
    try:
        return FORMATS[path.suffix.lower()]
    except KeyError:
        raise ValueError(f"{path}: unknown format {path.suffix!r} (.csv, .jsonl or .json, .parquet)") from None


def pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("Parquet needs pyarrow: pip install 'qtrel[bulk]'") from None
    return pq


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def pair_or_problem(query: Any, title: Any, qc: str, tc: str) -> tuple[str, str] | str:
    if query is None:
        return f"missing {qc!r}"
    if title is None:
        return f"missing {tc!r}"
    q, t = str(query), str(title)
    if not q.strip():
        return f"empty {qc!r}"
    if not t.strip():
        return f"empty {tc!r}"
    return q, t


def check_collision(names: Sequence[str], columns: Sequence[str], where: Path) -> None:
    clash = [c for c in names if c in columns]
    if clash:
        raise ValueError(
            f"{where} already has column(s) {', '.join(map(repr, clash))}: name the score columns "
            "apart with a prefix (--prefix pred_)"
        )


class _Builder:
    """Collects rows into chunks of `size`, dropping the first `skip` rows."""

    def __init__(self, size: int, skip: int):
        self.size, self.skip, self.seen = size, skip, 0
        self._new()

    def _new(self) -> None:
        self.start = self.seen
        self.lines: list[int] = []
        self.pairs: list[tuple[str, str] | None] = []
        self.problems: list[tuple[int, str]] = []
        self.rows: list = []

    def add(self, line: int, pair: tuple[str, str] | str, row) -> Chunk | None:
        self.seen += 1
        if self.seen <= self.skip:
            self.start = self.seen
            return None
        self.lines.append(line)
        self.rows.append(row)
        if isinstance(pair, str):
            self.pairs.append(None)
            self.problems.append((line, pair))
        else:
            self.pairs.append(pair)
        return self.flush() if len(self.lines) >= self.size else None

    def flush(self) -> Chunk | None:
        if not self.lines:
            return None
        chunk = Chunk(self.start, self.lines, self.pairs, self.problems, self.rows)
        self._new()
        return chunk


def _texts(level: list[str | None], values: np.ndarray) -> list[list[str]]:
    """Per row, the score columns as text: float32 in its shortest exact form, empty for a bad row."""
    text = values.astype(str).tolist()
    return [[lv, *t] if lv is not None else [""] * (1 + len(t)) for lv, t in zip(level, text)]


class _Lines:
    """Lines of a binary file, decoded, with the byte offset after the last line handed out."""

    def __init__(self, f):
        self.f, self.offset, self.ended = f, 0, True

    def __iter__(self):
        return self

    def __next__(self) -> str:
        raw = self.f.readline()
        if not raw:
            raise StopIteration
        self.offset += len(raw)
        self.ended = raw.endswith(b"\n")
        return raw.decode("utf-8")


def _cut(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.truncate(offset)


class _AppendSink:
    """CSV or JSON lines: each chunk appended with one write, flushed and synced."""

    def __init__(self, path: Path, head: str, rows_done: int):
        self.path, self.rows_done = path, rows_done
        self.f = path.open("ab")
        if self.f.tell() == 0 and head:
            self._write(head)

    def _write(self, text: str) -> None:
        self.f.write(text.encode("utf-8"))
        self.f.flush()
        os.fsync(self.f.fileno())

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self.f.close()


# --- CSV -------------------------------------------------------------------------------------------
class CsvSource:
    def __init__(self, path: Path, qc: str, tc: str):
        self.path, self.qc, self.tc = path, qc, tc
        with path.open(encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f), None)
        if not header:
            raise DataError(f"{path}: no header line")
        for c, flag in ((qc, "--query-column"), (tc, "--title-column")):
            if c not in header:
                raise DataError(f"{path}: no column {c!r} (columns: {', '.join(header)}); name it with {flag}")
        self.columns: list[str] = header
        self.total: int | None = None

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        n, iq, it = len(self.columns), self.columns.index(self.qc), self.columns.index(self.tc)
        b = _Builder(size, skip)
        with self.path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            next(reader)
            for row in reader:
                if not row:  # a blank line is no row
                    continue
                if len(row) != n:
                    pair: tuple[str, str] | str = f"{len(row)} fields, the header has {n}"
                    row = (row + [""] * n)[:n]
                else:
                    pair = pair_or_problem(row[iq], row[it], self.qc, self.tc)
                if (chunk := b.add(reader.line_num, pair, row)) is not None:
                    yield chunk
        if (chunk := b.flush()) is not None:
            yield chunk


class CsvSink(_AppendSink):
    def __init__(self, path: Path, source: CsvSource, names: list[str], resume: bool, size: int):
        check_collision(names, source.columns, source.path)
        self.header = [*source.columns, *names]
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(self.header)
        super().__init__(path, buf.getvalue(), self._resume(path, size) if resume else 0)

    def _resume(self, path: Path, size: int) -> int:
        """Complete rows in OUTPUT, down to a multiple of `size`; the file is cut back to them."""
        if not path.exists():
            return 0
        keep = done = count = 0
        with path.open("rb") as f:
            lines = _Lines(f)
            reader = csv.reader(lines)
            try:
                head = next(reader, None)
                if head is not None and lines.ended:
                    if head != self.header:
                        raise ValueError(
                            f"{path}: its columns {head} are not this run's {self.header}: not "
                            "the output of this input, model and --prefix"
                        )
                    keep = lines.offset
                    for row in reader:
                        if len(row) != len(self.header) or not lines.ended:
                            break
                        count += 1
                        if count % size == 0:
                            keep, done = lines.offset, count
            except csv.Error:  # a quoted field cut off at the end of the file
                pass
        _cut(path, keep)
        return done

    def write(self, chunk: Chunk, level: list[str | None], values: np.ndarray) -> None:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        for row, extra in zip(chunk.rows, _texts(level, values)):
            w.writerow(row + extra)
        self._write(buf.getvalue())
        self.rows_done += len(chunk)


# --- JSON lines ------------------------------------------------------------------------------------
class JsonlSource:
    def __init__(self, path: Path, qc: str, tc: str):
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        self.path, self.qc, self.tc = path, qc, tc
        self.columns: list[str] | None = None
        self.total: int | None = None

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        b = _Builder(size, skip)
        with self.path.open(encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if b.seen < b.skip:  # resumed: these rows are written already
                    b.add(n, ("", ""), None)
                    continue
                pair: tuple[str, str] | str
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    row, pair = {}, f"not JSON ({e})"
                else:
                    if isinstance(row, dict):
                        pair = pair_or_problem(row.get(self.qc), row.get(self.tc), self.qc, self.tc)
                    else:
                        row, pair = {}, "not a JSON object"
                if (chunk := b.add(n, pair, row)) is not None:
                    yield chunk
        if (chunk := b.flush()) is not None:
            yield chunk


class JsonlSink(_AppendSink):
    def __init__(self, path: Path, source: JsonlSource, names: list[str], resume: bool, size: int):
        self.names, self.source = names, source
        super().__init__(path, "", self._resume(path, size) if resume else 0)

    def _resume(self, path: Path, size: int) -> int:
        if not path.exists():
            return 0
        keep = done = count = 0
        with path.open("rb") as f:
            lines = _Lines(f)
            for line in lines:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    break
                if not lines.ended or not isinstance(row, dict) or any(c not in row for c in self.names):
                    break
                count += 1
                if count % size == 0:
                    keep, done = lines.offset, count
        _cut(path, keep)
        return done

    def write(self, chunk: Chunk, level: list[str | None], values: np.ndarray) -> None:
        vals = [[float(x) for x in t] for t in values.astype(str).tolist()]  # shortest float32 text
        out = []
        for row, lv, v in zip(chunk.rows, level, vals):
            check_collision(self.names, row, self.source.path)
            extra = dict(zip(self.names, [lv, *v] if lv is not None else [None] * len(self.names)))
            out.append(json.dumps({**row, **extra}, ensure_ascii=False) + "\n")
        self._write("".join(out))
        self.rows_done += len(chunk)
