"""Labelled query-title files (CSV or JSON lines), read strictly: every bad row is reported with its
file and line, and none is silently dropped."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path


class DataError(ValueError):
    """Rows that cannot be used; the message lists them as file:line: problem."""


@dataclass
class Example:
    query: str
    title: str
    label: int  # class index 0..levels-1
    relevance: float | None = None  # original 1..3 rating when the file has one (Home Depot)


@dataclass
class Dataset:
    examples: list[Example] = field(default_factory=list)
    path: str = ""

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [(e.query, e.title) for e in self.examples]

    @property
    def labels(self) -> list[int]:
        return [e.label for e in self.examples]


def records(path: Path):
    """(line number, dict) per record of a CSV or JSON-lines file; a bad JSON line yields its error instead."""
    if path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    yield n, e
                    continue
                yield n, row if isinstance(row, dict) else ValueError("not a JSON object")
    else:
        with path.open(encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            for row in reader:
                yield reader.line_num, row


def read_labelled(
    path: str | Path,
    labels: list[str],
    label_column: str = "level",
    label_map: dict[str, str] | None = None,
    max_errors: int = 20,
) -> Dataset:
    """Read `query`, `title` and a graded label. The label's value (after `label_map`) must be one of
    `labels` (e.g. "1".."5"); a `relevance` column, when present, is kept for RMSE on its scale."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    index = {lab: i for i, lab in enumerate(labels)}
    ds = Dataset(path=str(path))
    errors: list[str] = []
    for n, row in records(path):
        where = f"{path}:{n}"
        if isinstance(row, Exception):
            errors.append(f"{where}: {row}")
            continue
        problem = None
        for col in ("query", "title", label_column):
            if col not in row or row[col] is None:
                problem = f"missing column {col!r}"
                break
        if problem is None:
            q, t = str(row["query"]), str(row["title"])
            raw = row[label_column]
            raw = str(int(raw)) if isinstance(raw, (int, float)) and float(raw).is_integer() else str(raw)
            raw = (label_map or {}).get(raw, raw)
            if not q.strip():
                problem = "empty query"
            elif not t.strip():
                problem = "empty title"
            elif raw not in index:
                problem = f"label {row[label_column]!r} is not one of {labels}"
        if problem:
            errors.append(f"{where}: {problem}")
            if len(errors) >= max_errors:
                break
            continue
        rel = row.get("relevance")
        try:
            rel = float(rel) if rel not in (None, "") else None
        except (TypeError, ValueError):
            rel = None
        ds.examples.append(Example(q, t, index[raw], rel))
    if errors:
        more = f" (stopped at the first {max_errors})" if len(errors) >= max_errors else ""
        raise DataError(f"{len(errors)} bad row(s) in {path}{more}:\n" + "\n".join(errors))
    if not ds.examples:
        raise DataError(f"{path}: no rows")
    return ds
