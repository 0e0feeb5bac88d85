"""Score jobs' own model processes: as many as the live ones, of the same spec (so a job's bytes stay
`qtrel score`'s), each at the OS's idle priority (service.runtime.workers.priority). A job batch then never
holds a live model process, and the live model processes and the HTTP process take a CPU from it the moment
they want one, within the kernel's wake-up, not after a batch of ~0.5 s.

One per loaded copy of a model (its `Slot`), started when a job first sends a batch (forked from the fork
server's template, so the weights stay shared) and stopped when no job is left (`stop`, by the job runner),
so that a server without jobs pays no memory for them. A process that dies is replaced as any model process
is (its replica's restart policy, the watchdog, which does not count the time live work kept it waiting);
should they fail to start, the job's batches go to the live processes as before (`usable` is False until the
next start).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from model.levels import PairScore
from service.runtime.workers.backend import Backend, BackendError, Encoded, LoadSpec, NotReady, State
from service.runtime.workers.backend_process import ProcessBackend
from service.runtime.workers.worker import Worker, WorkerObserver

log = logging.getLogger("qtrel.jobs")


def idle_backend(spec: LoadSpec, name: str) -> Backend:
    """A model process at the OS's idle priority, named as a job's."""
    return ProcessBackend(spec, name.replace("qtrel-model", "qtrel-job"), idle=True)


class Background:
    """The job model processes of one loaded model copy, beside its live `worker`."""

    def __init__(
        self,
        live: Worker,
        observer: WorkerObserver,
        batch_timeout_s: float | None,
        on_count: Callable[[int], None] = lambda n: None,
    ):
        self.live, self.observer, self.batch_timeout_s = live, observer, batch_timeout_s
        self.on_count = on_count  # told the processes up (0 once stopped): the gauge
        self.worker: Worker | None = None
        self.error: str | None = None  # why they could not start; the live processes serve jobs meanwhile
        self._lock = asyncio.Lock()

    @property
    def size(self) -> int:
        return self.live.size

    @property
    def usable(self) -> bool:
        return self.error is None

    async def run(self, batch: Sequence[Encoded]) -> list[PairScore | BackendError]:
        """One batch on a job process (started first if none runs); raises NotReady if they cannot start."""
        worker = self.worker if self.worker is not None else await self._start()
        return await worker.run(batch)

    async def job(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """A named job (runner.JOBS) on a job process, e.g. a chunk's tokenising; raises as Worker.job."""
        worker = self.worker if self.worker is not None else await self._start()
        return await worker.job(name, *args, **kwargs)

    async def _start(self) -> Worker:
        async with self._lock:
            if self.worker is not None:
                return self.worker
            if self.error is not None:
                raise NotReady(self.error)
            worker = Worker(
                self.live.start_spec,  # the live processes' engine choice: the same bits
                replicas=self.size,
                observer=self.observer,
                batch_timeout_s=self.batch_timeout_s,
                backend=idle_backend,
            )
            worker.start()
            await worker.wait_ready()
            if worker.state != State.READY:
                self.error = f"job processes failed to start: {worker.error or worker.state.value}"
                log.error("%s; the live model processes run the jobs' batches", self.error)
                await asyncio.to_thread(worker.stop)
                raise NotReady(self.error)
            self.worker = worker
            log.info("job model processes up at %s priority (pids %s)", self.priority, worker.pids)
            self.on_count(worker.size)
            return worker

    async def stop(self) -> None:
        """No job is left: end the processes (a new job starts them again, and retries after a failed start)."""
        async with self._lock:
            if (worker := self.worker) is not None:  # a batch sent meanwhile is refused (NotReady) and sent again
                await asyncio.to_thread(worker.stop)
                self.on_count(0)
            self.worker, self.error = None, None

    @property
    def priority(self) -> str | None:
        info = self.worker.info if self.worker is not None else None
        return info.details.get("priority") if info is not None else None

    def crash_loops(self) -> list[int]:
        return self.worker.crash_loops() if self.worker is not None else []

    def describe(self) -> dict:
        w = self.worker
        return {
            "mode": "idle",
            "running": w is not None,
            "processes": self.size,
            "priority": self.priority,
            "pids": w.pids if w is not None else [],
            "replica_states": w.describe()["replica_states"] if w is not None else [],
            "restarts": w.restarts if w is not None else 0,
            "error": self.error,
        }
