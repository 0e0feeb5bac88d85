"""Parquet for bulk scoring (pyarrow, the `bulk` extra): a source read in chunks of exact size, and a sink
that writes each chunk as a part file in `OUTPUT.parts/` (written, then renamed) and joins the parts into
OUTPUT at the end, one row group per part. A restart counts the complete parts; a finished OUTPUT is
split back into its parts first, so that a resume of it works as any other.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from model.bulk.io import Chunk, check_collision, pair_or_problem, parts_dir, pyarrow_parquet
from model.data import DataError


def _table_chunks(pf, size: int) -> Iterator[Any]:
    """Tables of exactly `size` rows (the last one fewer) from a ParquetFile, whatever its row groups."""
    import pyarrow as pa

    buf = None
    for batch in pf.iter_batches(batch_size=size):
        t = pa.Table.from_batches([batch])
        buf = t if buf is None else pa.concat_tables([buf, t])
        while buf.num_rows >= size:
            yield buf.slice(0, size)
            buf = buf.slice(size)
    if buf is not None and buf.num_rows:
        yield buf


def append_scores(table, names: list[str], level: list[str | None], values: np.ndarray):
    """The pyarrow table with the score columns (model.bulk.io.score_columns) after its own: level a string,
    the rest float32, null for bad rows."""
    import pyarrow as pa

    bad = np.array([lv is None for lv in level], dtype=bool)
    table = table.append_column(names[0], pa.array(level, pa.string()))
    for j, name in enumerate(names[1:]):
        table = table.append_column(name, pa.array(values[:, j], pa.float32(), mask=bad))
    return table


class ParquetSource:
    def __init__(self, path: Path, qc: str, tc: str):
        pq = pyarrow_parquet()
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        self.path, self.qc, self.tc = path, qc, tc
        pf = pq.ParquetFile(path)
        self.columns: list[str] = pf.schema_arrow.names
        self.total: int | None = pf.metadata.num_rows
        for c, flag in ((qc, "--query-column"), (tc, "--title-column")):
            if c not in self.columns:
                raise DataError(f"{path}: no column {c!r} (columns: {', '.join(self.columns)}); name it with {flag}")

    def chunks(self, size: int, skip: int = 0) -> Iterator[Chunk]:
        pf = pyarrow_parquet().ParquetFile(self.path)
        start = 0
        for t in _table_chunks(pf, size):
            if start + t.num_rows <= skip:
                start += t.num_rows
                continue
            if start < skip:
                t, start = t.slice(skip - start), skip
            lines = list(range(start + 1, start + t.num_rows + 1))
            pairs: list[tuple[str, str] | None] = []
            problems = []
            for line, q, ti in zip(lines, t.column(self.qc).to_pylist(), t.column(self.tc).to_pylist()):
                p = pair_or_problem(q, ti, self.qc, self.tc)
                pairs.append(None if isinstance(p, str) else p)
                if isinstance(p, str):
                    problems.append((line, p))
            yield Chunk(start, lines, pairs, problems, t)
            start += t.num_rows


class ParquetSink:
    def __init__(self, path: Path, source: ParquetSource, names: list[str], resume: bool, size: int):
        check_collision(names, source.columns, source.path)
        self.path, self.names, self.parts = path, names, parts_dir(path)
        self.pq = pyarrow_parquet()
        if resume and path.exists() and not self.parts.exists():
            self._explode(size)  # a finished file: back into its parts, then on as any restart
        self.parts.mkdir(parents=True, exist_ok=True)
        for tmp in self.parts.glob("*.tmp"):
            tmp.unlink()
        done = sorted(self.parts.glob("part-*.parquet"))
        if not resume:
            for p in done:
                p.unlink()
            done = []
        if [p.name for p in done] != [self._name(i) for i in range(len(done))]:
            raise ValueError(f"{self.parts}: parts are missing or foreign: {[p.name for p in done]}")
        counts = [self.pq.ParquetFile(p).metadata.num_rows for p in done]
        if any(c != size for c in counts[:-1]):
            raise ValueError(
                f"{self.parts}: parts of {sorted(set(counts))} rows; resume with the first run's --chunk-rows"
            )
        self.index, self.rows_done = len(done), sum(counts)

    @staticmethod
    def _name(i: int) -> str:
        return f"part-{i:06d}.parquet"

    def _explode(self, size: int) -> None:
        self.parts.mkdir()
        for i, t in enumerate(_table_chunks(self.pq.ParquetFile(self.path), size)):
            self._put(i, t)

    def _put(self, i: int, table) -> None:
        tmp = self.parts / (self._name(i) + ".tmp")
        self.pq.write_table(table, tmp)
        os.replace(tmp, self.parts / self._name(i))

    def write(self, chunk: Chunk, level: list[str | None], values: np.ndarray) -> None:
        self._put(self.index, append_scores(chunk.rows, self.names, level, values))
        self.index += 1
        self.rows_done += len(chunk)

    def close(self) -> None:
        pass

    def finish(self) -> None:
        """Join the parts into OUTPUT (one row group per part), then remove them."""
        parts = [self.parts / self._name(i) for i in range(self.index)]
        tmp = self.path.with_name(self.path.name + ".tmp")
        writer = None
        for p in parts:
            t = self.pq.read_table(p)
            writer = writer or self.pq.ParquetWriter(tmp, t.schema)
            writer.write_table(t)
        if writer is None:
            raise DataError(f"{self.path}: no rows to write")
        writer.close()
        os.replace(tmp, self.path)
        shutil.rmtree(self.parts)
