"""What a job's input must pass before the job is queued: a readable file of a known format, the query and
title columns, no clash with the score columns, at most job_max_rows rows, and (without skip_bad) no bad
row. Read with the very sources `qtrel score` reads with (model.bulk), so a job refused here would have
failed there too."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from model.bulk.io import check_collision
from model.bulk.score import SOURCES, score_names
from model.data import DataError
from service.errors import ErrorKind, ServiceError
from service.jobs.api import JobOptions

SHOWN = 5  # bad rows named in a refusal


def count_rows(path: Path, name: str, fmt: str, options: JobOptions, labels: Sequence[str], max_rows: int) -> int:
    """The input's rows; a ServiceError (413 over max_rows, 422 unreadable or wrong) otherwise. `name`: the
    file as the client knows it, for the messages."""
    try:
        source = SOURCES[fmt](path, options.query_column, options.title_column)
        names = score_names(labels, options.prefix, options.max_chunks is not None)
        if source.columns is not None:
            check_collision(names, source.columns, Path(name))
        rows, problems = 0, list[tuple[int, str]]()
        for chunk in source.chunks(10_000):
            rows += len(chunk)
            problems.extend(chunk.problems[: SHOWN - len(problems)])
            if rows > max_rows:
                raise ServiceError(ErrorKind.TOO_LARGE, f"the input has more than {max_rows} rows (job_max_rows)")
    except ServiceError:
        raise
    except (DataError, ValueError, OSError, UnicodeDecodeError) as e:
        raise ServiceError(ErrorKind.VALIDATION, f"the input cannot be scored: {_plain(e, path, name)}") from None
    except Exception as e:  # pyarrow's errors on a file that is not Parquet, among others
        raise ServiceError(ErrorKind.VALIDATION, f"the input is not readable as {fmt}: {type(e).__name__}") from None
    if rows == 0:
        raise ServiceError(ErrorKind.VALIDATION, "the input has no rows")
    if problems and not options.skip_bad:
        where = "; ".join(f"row at line {line}: {why}" for line, why in problems)
        raise ServiceError(
            ErrorKind.VALIDATION, f"bad rows in the input ({where}); fix them, or set skip_bad to score them as empty"
        )
    return rows


def _plain(e: Exception, path: Path, name: str) -> str:
    """The error without the server's path of the file (the client knows its file by its own name)."""
    return (
        str(e)
        .replace(str(path), name)
        .replace("--query-column", "query_column")
        .replace("--title-column", "title_column")
        .replace("--prefix", "prefix")
    )
