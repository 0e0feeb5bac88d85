"""What HTTP knows of score jobs: a job's record, its options, and the calls the routes make.

Model-free and torch-free: the routes (service.http.jobs) reach jobs only through the `Jobs` protocol; the
desk (service.jobs.desk) answers them from the jobs directory in every HTTP process, and the runner
(service.jobs.runner, which scores the files with model.bulk) runs beside the model processes. A job's shape
follows OpenAI's batch object (`id`, `object`, `status`, `created_at` and the other `*_at` stamps,
`request_counts`, `error`), so its clients read it without surprise."""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Protocol

# queued -> in_progress -> finalizing -> completed; or failed; or cancelling -> cancelled
Status = Literal["queued", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled"]
STATUSES: tuple[Status, ...] = ("queued", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled")
FINISHED: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}  # as `qtrel score` reads


def format_of(name: str) -> str | None:
    """The input format a file name's suffix names (`qtrel score`'s rule), None for another suffix."""
    return FORMATS.get(Path(name).suffix.lower())


@dataclass(frozen=True)
class JobOptions:
    """`qtrel score`'s options that a job takes (its defaults too); the server's model, precision and
    max_length stand for `--model`, `--dtype` and `--max-length`."""

    model: str | None = None  # a served model's name; None: the default model
    query_column: str = "query"
    title_column: str = "title"
    prefix: str = ""
    skip_bad: bool = False
    max_chunks: int | None = None
    chunk_overlap: int | None = None  # None: qtrel score's default (model.levels.CHUNK_OVERLAP)
    truncation: Literal["only_second", "longest_first"] = "only_second"
    chunk_rows: int = 20000  # rows read, scored and written at a time: the unit a restart resumes from


@dataclass
class Job:
    """A job's record, kept as `job.json` in its directory and rewritten whole (atomically) on each change."""

    id: str
    filename: str  # the input's name as given (upload) or its path (input_path)
    format: str  # csv, jsonl or parquet
    input_bytes: int
    options: JobOptions
    owner: str | None = None  # the id of the API key that submitted it (never the key)
    source: Literal["upload", "path"] = "upload"
    model: str = ""  # the served model's name and precision, resolved at submission
    dtype: str = ""
    status: Status = "queued"
    created_at: int = field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    total: int = 0  # rows of the input
    done: int = 0  # rows written (scored or, with skip_bad, written with empty scores)
    bad: int = 0  # rows without a score (skip_bad)
    pairs_per_s: float = 0.0  # this run's rate, once measured
    error: str | None = None
    output_bytes: int | None = None

    @staticmethod
    def new_id() -> str:
        """Ids sort by creation (nanoseconds, in hex of a fixed width), then a random part."""
        return f"job_{time.time_ns():016x}{secrets.token_hex(4)}"

    @property
    def finished(self) -> bool:
        return self.status in FINISHED

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Job:
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        return cls(**{**data, "options": JobOptions(**data["options"])})

    def public(self) -> dict[str, Any]:
        """The job as the API shows it (OpenAI's batch object, with qtrel's progress and options)."""
        left = max(self.total - self.done, 0)
        eta = round(left / self.pairs_per_s, 1) if self.pairs_per_s > 0 and not self.finished else None
        return {
            "id": self.id,
            "object": "job",
            "endpoint": "/score",
            "model": self.model,
            "dtype": self.dtype,
            "status": self.status,
            "input": {
                "filename": self.filename,
                "format": self.format,
                "bytes": self.input_bytes,
                "source": self.source,
            },
            "options": asdict(self.options),
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {"total": self.total, "completed": self.done - self.bad, "failed": self.bad},
            "progress": {"rows_done": self.done, "pairs_per_s": round(self.pairs_per_s, 1), "eta_s": eta},
            "error": {"message": self.error, "type": "job_failed"} if self.error else None,
            "output": (
                {
                    "url": f"/v1/jobs/{self.id}/output",
                    "filename": f"{self.id}.{self.format}",
                    "bytes": self.output_bytes,
                }
                if self.status == "completed"
                else None
            ),
        }


class Jobs(Protocol):
    """Score jobs as the routes use them (service.jobs.desk.JobDesk). Refusals are ServiceErrors
    (service.errors), raised before anything is queued."""

    @property
    def max_bytes(self) -> int: ...

    def incoming(self, filename: str) -> Path: ...  # where an upload is written before it is submitted

    async def submit(
        self, input: Path, filename: str, options: JobOptions, owner: str | None, uploaded: bool
    ) -> Job: ...

    def get(self, job_id: str, owner: str | None) -> Job: ...

    def list(self, owner: str | None, after: str | None, limit: int) -> tuple[list[Job], bool]: ...

    async def cancel(self, job_id: str, owner: str | None) -> Job: ...

    async def delete(self, job_id: str, owner: str | None) -> Job: ...

    def output(self, job_id: str, owner: str | None) -> Path: ...
