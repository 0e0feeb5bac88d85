"""The job runner: the one owner of running score jobs, beside the engine that owns the model processes (a
one-process server's, or the engine core's with several fronts). It runs the queued jobs one at a time, oldest
first, and on start resumes every unfinished job from the last chunk its output holds. The desks
(service.jobs.desk, in the HTTP processes) check and create jobs and tell it what changed (`wake`); once a
job exists, its record is the runner's alone to rewrite.

A job is `qtrel score` itself: where the model has a job driver (service.runtime.background, `job_processes`
idle), a process at the OS's idle priority runs model.bulk's `score_file` on the job's files, and this runner
only starts it, records each chunk it reports written and synced, and kills it to cancel or stop. Elsewhere
(`shared`) `run_file` runs here on a thread with the live model processes as its forward pass
(service.jobs.scoring), the engine's calls on the event loop. Either way the output is byte for byte what
`qtrel score` writes with the same model and precision, and a restart cuts a torn chunk off and goes on.

Self-contained (`start`, `stop`, `wake`) so that whoever owns the engine owns it: the app's lifespan in one
process, service.core_main with fronts."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path

from model.bulk.score import ScoreOptions, run_file
from model.levels import CHUNK_OVERLAP
from service.jobs.api import STATUSES, Job, Status
from service.jobs.scoring import Cancelled, EngineScorer, Stopped
from service.jobs.store import JobStore
from service.metrics import Metrics
from service.runtime.background import DriverDied, DriverFailed, Interrupted, JobBroke
from service.runtime.engine import Engine, NotReady
from service.runtime.whole import job_processes, stop_job_processes
from service.runtime.workers.driver import Task, Written
from service.runtime.workers.worker import ModelInfo
from service.settings import Settings

log = logging.getLogger("qtrel.jobs")

RETRY_S = 0.5  # while a job waits for its model to serve
DRIVER_DEATHS = 3  # a job whose driver dies this often in a row without writing a chunk fails


class JobRunner:
    def __init__(self, settings: Settings, engine: Engine, metrics: Metrics):
        assert settings.jobs_dir is not None
        self.settings, self.engine, self.metrics = settings, engine, metrics
        self.store = JobStore(settings.jobs_dir, clean=True)
        self.jobs: dict[str, Job] = {}  # by id, oldest first
        self._lock = threading.Lock()  # the records are saved from the loop and from run_file's thread
        self._cancel: set[str] = set()
        self._stopping = False
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        for job in await asyncio.to_thread(self.store.load, True):
            if job.status == "cancelling":
                self._end(job, "cancelled")
                self.store.drop_output(job)
            elif not job.finished:
                job.status = "queued"  # resumed where its output ends
            self.jobs[job.id] = job
        self._sweep()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="qtrel-jobs")
        n = sum(not j.finished for j in self.jobs.values())
        log.info("score jobs in %s: %d on disk, %d to run", self.store.root, len(self.jobs), n)

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop after the slices in flight: the running job stays unfinished and resumes at the next start."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except TimeoutError:
                log.warning("the job runner did not stop within %.0fs", timeout)

    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            job = min((j for j in self.jobs.values() if j.status == "queued"), key=lambda j: j.id, default=None)
            if job is None:
                self._wake.clear()
                await stop_job_processes(self.engine)  # their memory back while no job runs
                await self._wake.wait()
                continue
            try:
                await self._run(job)
            except Exception:  # a bug here must not end the runner
                log.exception("job %s", job.id)
            self._sweep()

    # --- the desks' news ----------------------------------------------------------------------
    async def wake(self, change: dict[str, str]) -> dict | None:
        """A desk changed the jobs directory: {"queued": id} a new job; {"cancel": id} cancel it (its record
        after, None for no such job); {"deleted": id} a finished job's folder removed."""
        if (job_id := change.get("queued")) is not None:
            self._adopt(job_id)
        elif (job_id := change.get("cancel")) is not None:
            job = self.jobs.get(job_id) or self._adopt(job_id)
            if job is None:
                return None
            self._cancel_job(job)
            return job.record()
        elif (job_id := change.get("deleted")) is not None:
            self.jobs.pop(job_id, None)
            self._gauges()
        return None

    def _adopt(self, job_id: str) -> Job | None:
        """A job a desk created: its record, read once (a few hundred bytes), is the runner's from now on."""
        if job_id not in self.jobs and (job := self.store.read(job_id)) is not None:
            self.jobs[job.id] = job
            self._gauges()
            if self._wake is not None:
                self._wake.set()
        return self.jobs.get(job_id)

    def _cancel_job(self, job: Job) -> None:
        if job.status == "queued":
            self._end(job, "cancelled")
        elif not job.finished and job.status != "cancelling":
            self._cancel.add(job.id)
            job.status, job.cancelling_at = "cancelling", int(time.time())
            self._save(job)

    # --- running ------------------------------------------------------------------------------
    async def _run(self, job: Job) -> None:
        info = await self._model_info(job)
        if info is None:
            return
        job.status, job.in_progress_at = "in_progress", job.in_progress_at or int(time.time())
        self._save(job)
        out = self.store.output(job)
        try:
            await self._score(job, info, out)
        except Stopped:
            log.info("job %s stops at row %d: it resumes at the next start", job.id, job.done)
        except Cancelled:
            self.store.drop_output(job)
            self._end(job, "cancelled")
        except Exception as e:
            log.warning("job %s failed: %s", job.id, e)
            self.store.drop_output(job)
            broke = e.broke if isinstance(e, JobBroke) else None
            text, code = (broke.message, broke.errno) if broke else (str(e) or type(e).__name__, _errno(e))
            job.error = _reason(text, code, self.store.folder(job.id), job.filename)
            self._end(job, "failed")
        else:
            job.output_bytes = out.stat().st_size
            self._end(job, "completed")
        finally:
            self._cancel.discard(job.id)

    async def _score(self, job: Job, info: ModelInfo, out: Path) -> None:
        """The job in its model's driver (the serving process does none of its work); where the model has none,
        or it could not load, run_file here with the live processes as its forward pass (service.jobs.scoring)."""
        o = job.options
        options = ScoreOptions(
            query_column=o.query_column,
            title_column=o.title_column,
            prefix=o.prefix,
            skip_bad=o.skip_bad,
            max_chunks=o.max_chunks,
            chunk_overlap=CHUNK_OVERLAP if o.chunk_overlap is None else o.chunk_overlap,
        )
        task = Task(str(self.store.input(job)), str(out), options, o.truncation, o.chunk_rows, workers=0)
        deaths = 0  # in a row, without a chunk written
        while (bg := job_processes(self.engine, job.model)) is not None:
            before = job.done
            try:
                await bg.drive(task, lambda w: self._written(job, w), lambda: self._halt(job))
                return
            except DriverDied as e:
                deaths = 1 if job.done > before else deaths + 1
                if deaths >= DRIVER_DEATHS:
                    raise RuntimeError(f"{e}, {deaths} times in a row without writing a chunk") from None
                log.warning("job %s: %s; it resumes from row %d", job.id, e, job.done)
                await asyncio.sleep(RETRY_S)
            except Interrupted:  # a reload: on the copy that serves next, from the last chunk written
                while self.engine.models.get(job.model).current.background is bg and not self._stopping:
                    await asyncio.sleep(RETRY_S)  # an in-place reload: the new copy is not in place yet
                if await self._model_info(job) is None:
                    raise Stopped() from None
            except DriverFailed:
                break
        scorer = EngineScorer(self.engine, job, info, asyncio.get_running_loop(), lambda: self._halt(job))
        await asyncio.to_thread(
            run_file,
            scorer,
            self.store.input(job),
            out,
            options,
            chunk_rows=o.chunk_rows,
            resume=True,
            progress=False,
            on_chunk=lambda rows, bad: self._chunk_done(job, rows, bad, scorer.rate),
        )

    async def _model_info(self, job: Job) -> ModelInfo | None:
        """The job's model once it serves (it may be loading after a restart); None when stopping."""
        while not self._stopping:
            try:
                # (no job starts while the server drains: it takes only the requests its HTTP server holds)
                if not self.engine.draining and (info := self.engine.require_ready(job.model).current.info) is not None:
                    return info
            except NotReady:
                pass
            except Exception as e:  # the model is no longer served
                job.error = str(e)
                self._end(job, "failed")
                return None
            await asyncio.sleep(RETRY_S)
        return None

    def _halt(self, job: Job) -> Exception | None:
        return Stopped() if self._stopping else Cancelled() if job.id in self._cancel else None

    async def _written(self, job: Job, w: Written) -> None:
        """The driver wrote and synced a chunk: the record follows (saved off the event loop)."""
        await asyncio.to_thread(self._chunk_done, job, w.rows, w.bad, w.run_rows / max(w.run_s, 1e-9))

    def _chunk_done(self, job: Job, rows: int, bad: int, rate: float) -> None:
        """After a chunk is written and synced (on a thread): the record follows."""
        added = max(rows - job.done, 0)
        job.bad += bad
        self.metrics.job_pairs.inc(max(added - bad, 0))
        job.done, job.pairs_per_s = rows, rate
        if rows >= job.total and job.status == "in_progress":
            job.status, job.finalizing_at = "finalizing", int(time.time())
        self._save(job)

    # --- the record ---------------------------------------------------------------------------
    def _save(self, job: Job) -> None:
        with self._lock:
            if self.store.folder(job.id).is_dir():
                self.store.save(job)
        self._gauges()

    def _end(self, job: Job, status: Status) -> None:
        job.status = status
        setattr(job, f"{status}_at", int(time.time()))
        if status != "completed":
            job.pairs_per_s = 0.0
        self._save(job)

    def _gauges(self) -> None:
        counts = Counter(j.status for j in self.jobs.values())
        for state in STATUSES:
            self.metrics.jobs.labels(state).set(counts.get(state, 0))
        left = sum(max(j.total - j.done, 0) for j in self.jobs.values() if not j.finished)
        self.metrics.job_queue_pairs.set(left)

    def _sweep(self) -> None:
        """Delete finished jobs older than job_keep_s."""
        keep = self.settings.job_keep_s
        if not keep:
            return
        now = time.time()
        for job in list(self.jobs.values()):
            ended = job.completed_at or job.failed_at or job.cancelled_at
            if job.finished and ended is not None and now - ended > keep:
                self.store.remove(job)
                del self.jobs[job.id]
        self._gauges()


def _errno(e: Exception) -> int | None:
    return e.errno if isinstance(e, OSError) else None


def _reason(text: str, errno: int | None, folder: Path, name: str) -> str:
    """Why a job failed, in the client's terms: its file by its own name, never the server's paths."""
    if errno == 28:
        return "the jobs directory is full (no space left on the device)"
    return text.replace(str(folder / "input"), name).replace(str(folder) + os.sep, "")
