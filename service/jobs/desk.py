"""The routes' side of score jobs (the `Jobs` calls of service.jobs.api), in every HTTP process: a one-process
server's, or each front's (service.front) beside one engine core. It checks and creates a job, and answers
its status, the list, its output, cancel and delete from the jobs directory, the truth for every process;
then it tells the runner (service.jobs.runner, beside the model processes) what changed: `tell({"queued":
id})`, `tell({"cancel": id})` (the runner owns a job's record once it exists: it answers the record after),
`tell({"deleted": id})`. In one process `tell` is the runner's `wake`; in a front, the call "jobs_wake" to the
engine core (service.runtime.core)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from service.errors import ErrorKind, ServiceError
from service.jobs.api import Job, JobOptions, format_of
from service.jobs.checks import count_rows
from service.jobs.store import JobStore
from service.runtime.workers.worker_api import ModelInfo
from service.settings import Settings

log = logging.getLogger("qtrel.jobs")

Tell = Callable[[dict[str, str]], Awaitable[Any]]


class JobDesk:
    def __init__(self, settings: Settings, model_info: Callable[[str | None], tuple[str, ModelInfo]], tell: Tell):
        """`model_info(name)`: the served model's name and info, refused (NotReady, ModelNotFound) as scoring is."""
        assert settings.jobs_dir is not None
        self.settings, self.model_info, self.tell = settings, model_info, tell
        self.store = JobStore(settings.jobs_dir)

    # --- submission ---------------------------------------------------------------------------
    @property
    def max_bytes(self) -> int:
        return self.settings.job_max_bytes

    def incoming(self, filename: str) -> Path:
        return self.store.incoming(Path(filename).suffix.lower())

    async def submit(self, input: Path, filename: str, options: JobOptions, owner: str | None, uploaded: bool) -> Job:
        """Check the job and queue it, or refuse it (ServiceError) with nothing queued. `uploaded`: `input` is
        an upload under `.incoming/`, moved into the job (and removed on refusal); else an input_path."""
        try:
            return await self._submit(input, filename, options, owner, uploaded)
        finally:
            if uploaded:
                input.unlink(missing_ok=True)

    async def _submit(self, input: Path, name: str, options: JobOptions, owner: str | None, uploaded: bool) -> Job:
        s = self.settings
        fmt = format_of(name)
        if fmt is None:
            raise ServiceError(ErrorKind.VALIDATION, f"{name}: unknown format (.csv, .jsonl or .json, .parquet)")
        if not uploaded:
            input = self._allowed(input)
        size = input.stat().st_size
        if size > s.job_max_bytes:
            raise ServiceError(ErrorKind.TOO_LARGE, f"the input has {size} bytes; at most {s.job_max_bytes}")
        need = size * (2 if uploaded else 3)  # output ~ the input again (and a copy of an input_path)
        await asyncio.to_thread(self._check_room, need)
        served, info = self.model_info(options.model)  # ModelNotFound: 404; NotReady: 503
        if options.model is not None and options.model != served:  # strict: a night's work on the wrong model
            raise ServiceError(ErrorKind.MODEL_NOT_FOUND, f"model {options.model!r} is not served (GET /v1/models)")
        rows = await asyncio.to_thread(count_rows, input, name, fmt, options, info.labels, s.job_max_rows)
        await asyncio.to_thread(self._check_room, need)  # again: others may have come in meanwhile
        job = Job(Job.new_id(), name, fmt, size, options, owner, "upload" if uploaded else "path", total=rows)
        job.model, job.dtype = served, info.dtype
        await asyncio.to_thread(self.store.create, job, input, uploaded)
        log.info("job %s queued: %d rows of %s (%s) for %s", job.id, rows, fmt, job.source, job.model)
        await self.tell({"queued": job.id})  # on disk already: a runner that misses this finds it at its start
        return job

    def _allowed(self, path: Path) -> Path:
        """An input_path inside one of job_input_dirs (links resolved first), as a readable file."""
        roots = self.settings.job_input_roots
        real = path.resolve()
        if not roots or not any(real.is_relative_to(r) for r in roots):
            where = ", ".join(map(str, roots)) or "none: set QTREL_JOB_INPUT_DIRS"
            raise ServiceError(ErrorKind.FORBIDDEN, f"{path} is outside the directories jobs may read ({where})")
        if not real.is_file() or not os.access(real, os.R_OK):
            raise ServiceError(ErrorKind.VALIDATION, f"{path}: no such readable file")
        return real

    def _check_room(self, need: int) -> None:
        s = self.settings
        if sum(not j.finished for j in self.store.load()) >= s.job_max_jobs:
            raise ServiceError(
                ErrorKind.OVERLOADED, f"{s.job_max_jobs} jobs are queued or running (job_max_jobs)", retry_after=60
            )
        free = self.store.free_bytes()
        if free - need < s.job_min_free_bytes:
            raise ServiceError(
                ErrorKind.NO_SPACE,
                f"the jobs directory has {free} bytes free; this job needs about {need} and "
                f"{s.job_min_free_bytes} must stay free (job_min_free_bytes)",
            )

    # --- the other calls ----------------------------------------------------------------------
    def get(self, job_id: str, owner: str | None) -> Job:
        job = self.store.read(job_id)
        if job is None or (owner is not None and job.owner != owner):
            raise ServiceError(ErrorKind.NOT_FOUND, f"no job {job_id!r}")
        return job

    def list(self, owner: str | None, after: str | None, limit: int) -> tuple[list[Job], bool]:
        """Newest first, from after the job `after` (OpenAI's cursor); (page, whether more follow)."""
        mine = [j for j in reversed(self.store.load()) if owner is None or j.owner == owner]
        if after is not None:
            ids = [j.id for j in mine]
            if after not in ids:
                raise ServiceError(ErrorKind.NOT_FOUND, f"no job {after!r} (after)")
            mine = mine[ids.index(after) + 1 :]
        return mine[:limit], len(mine) > limit

    async def cancel(self, job_id: str, owner: str | None) -> Job:
        job = self.get(job_id, owner)
        if not job.finished:
            record = await self.tell({"cancel": job.id})  # the runner's: it may be running the job
            if record is None:
                raise ServiceError(ErrorKind.NOT_FOUND, f"no job {job_id!r}")
            job = Job.from_record(record)
            if job.status in ("cancelling", "cancelled"):
                return job
        raise ServiceError(ErrorKind.CONFLICT, f"job {job_id} is {job.status}: nothing to cancel")

    async def delete(self, job_id: str, owner: str | None) -> Job:
        job = self.get(job_id, owner)
        if not job.finished:
            raise ServiceError(ErrorKind.CONFLICT, f"job {job_id} is {job.status}: cancel it first")
        await asyncio.to_thread(self.store.remove, job)
        await self.tell({"deleted": job.id})
        return job

    def output(self, job_id: str, owner: str | None) -> Path:
        job = self.get(job_id, owner)
        if job.status != "completed":
            raise ServiceError(ErrorKind.CONFLICT, f"job {job_id} is {job.status}: its output comes once it completes")
        return self.store.output(job)
