"""The jobs directory: one folder per job with its record (`job.json`, replaced atomically on every change),
its input (`input.<format>`) and its output (`output.<format>`, written chunk by chunk by model.bulk's sinks,
which a restart resumes), and `.incoming/` for uploads not yet submitted.

Two users, each writing its own part: the desk (service.jobs.desk, in every HTTP process) creates a job's
folder and removes a finished one; the runner (service.jobs.runner, beside the model processes) alone rewrites
the record of a job once it exists. Readers take the record as it is on disk: the truth for every process."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

from service.jobs.api import Job

log = logging.getLogger("qtrel.jobs")

RECORD = "job.json"
JOB_ID = re.compile(r"job_[0-9a-f]{16,40}")  # Job.new_id's shape: anything else names no folder of ours


class JobStore:
    def __init__(self, root: Path, clean: bool = False):
        """`clean`: the server starts (the runner's store): uploads cut off by a restart are removed."""
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.spool = root / ".incoming"
        if clean:
            shutil.rmtree(self.spool, ignore_errors=True)
        self.spool.mkdir(exist_ok=True)

    def folder(self, job_id: str) -> Path:
        return self.root / job_id

    def input(self, job: Job) -> Path:
        return self.folder(job.id) / f"input.{job.format}"

    def output(self, job: Job) -> Path:
        return self.folder(job.id) / f"output.{job.format}"

    def incoming(self, suffix: str) -> Path:
        return self.spool / (secrets.token_hex(8) + suffix)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free

    def save(self, job: Job) -> None:
        """Write the record whole, then rename it over the old one: a crash leaves the old or the new one."""
        folder = self.folder(job.id)
        tmp = folder / (RECORD + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            json.dump(job.record(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / RECORD)

    def create(self, job: Job, input: Path, move: bool) -> None:
        """The job's folder with its input (moved there from `.incoming/`, or copied from an allowed path)
        and its record, the record last: a folder without one is an unfinished submission."""
        folder = self.folder(job.id)
        folder.mkdir()
        try:
            if move:
                os.replace(input, self.input(job))
            else:
                shutil.copyfile(input, self.input(job))
            self.save(job)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def read(self, job_id: str) -> Job | None:
        """The job's record as on disk; None for an id of no job (or of one still being created)."""
        if not JOB_ID.fullmatch(job_id):
            return None
        try:
            return Job.from_record(json.loads((self.folder(job_id) / RECORD).read_text(encoding="utf-8")))
        except FileNotFoundError:
            return None

    def load(self, clean: bool = False) -> list[Job]:
        """Every job on disk, oldest first. `clean` (the runner at start, alone then): folders without a
        readable record are removed; others skip them (a submission in progress in another process)."""
        jobs = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir() and JOB_ID.fullmatch(p.name)):
            try:
                if (job := self.read(folder.name)) is not None:
                    jobs.append(job)
                    continue
                error: Exception = FileNotFoundError(RECORD)
            except (OSError, ValueError, TypeError, KeyError) as e:
                error = e
            if clean:
                log.warning("removing %s: no readable job record (%s)", folder, error)
                shutil.rmtree(folder, ignore_errors=True)
        return sorted(jobs, key=lambda j: j.id)

    def remove(self, job: Job) -> None:
        shutil.rmtree(self.folder(job.id), ignore_errors=True)

    def drop_output(self, job: Job) -> None:
        out = self.output(job)
        out.unlink(missing_ok=True)
        shutil.rmtree(out.with_name(out.name + ".parts"), ignore_errors=True)
