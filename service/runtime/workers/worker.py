"""The worker: the one owner of the model instances.

It runs `replicas` backends (`service.runtime.workers.backend`), each held by one caller at a time. A batch
(`run`) for a free model process is sent and its reply read by the event loop itself, with no thread to wake
(`Replica.drive`); a named extra job (`job`, e.g. "explain"), a thread-mode model's batch and a batch that
finds every process busy or restarting go to one shared queue, which each replica's thread serves when its
model is free. State lives in one place per part: each replica's `StateMachine`, and the worker's, which
summarises them (loading, warming, ready, restarting, failed, stopping, stopped): ready while one
replica is.

Faults: a model process that dies -- in a job, while idle, or while loading or warming up after a
restart -- or that the watchdog kills because it held one job longer than `batch_timeout_s` (stuck, or
stopped), is replaced by its replica while the others keep serving, with backoff when it keeps dying
(`RestartPolicy`); a crash loop shows in `alive()`. A batch whose process died is retried once; a batch
that fails again, or that the model raised for, is split in halves and each half retried, so that only
the pair that fails alone fails (a poison request) and the others get their scores. Only a checkpoint
that cannot be loaded at start fails the worker.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from model.levels import split_rows
from model.tokenizer import PairTokenizer
from service.runtime.workers.backend import (
    Backend,
    BackendError,
    Encoded,
    Forward,
    Job,
    LoadSpec,
    ModelError,
    NotReady,
    ProcessDied,
    State,
    StateMachine,
)
from service.runtime.workers.backend_process import ProcessBackend
from service.runtime.workers.replica import ENDING, Replica, RestartPolicy
from service.runtime.workers.worker_api import ModelInfo, NoObserver, WorkerObserver

__all__ = ["ModelInfo", "RestartPolicy", "Worker", "WorkerObserver"]

log = logging.getLogger("qtrel.worker")


@dataclass(eq=False, slots=True)
class Pending:
    """A job and the event loop's future it settles: the replica thread hands the outcome back with one
    `call_soon_threadsafe` (no concurrent.futures.Future, whose Condition and callbacks cost the loop more)."""

    message: Forward | Job
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def taken(self) -> bool:
        """False if the awaiting task has gone (cancelled): the job is skipped."""
        return not self.future.done()

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, value, error)
        except RuntimeError:  # the loop is closed: nobody waits
            pass


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class Worker:
    """Runs jobs on `replicas` model instances: child processes (`mode="process"`) or one model on a
    thread of this process (`mode="thread"`). `backend` makes a replica's backend from its spec and name
    where another implementation of the contract is wanted (a test's); by default the mode's. See the
    module doc."""

    def __init__(
        self,
        spec: LoadSpec,
        mode: str = "process",
        replicas: int = 1,
        observer: WorkerObserver | None = None,
        batch_timeout_s: float | None = None,
        restarts: RestartPolicy | None = None,
        backend: Callable[[LoadSpec, str], Backend] | None = None,
    ):
        if mode not in ("process", "thread"):
            raise ValueError(f"worker mode must be 'process' or 'thread', got {mode!r}")
        if replicas < 1 or (mode == "thread" and replicas != 1):
            raise ValueError(f"replicas must be >= 1 (exactly 1 in thread mode), got {replicas}")
        self.spec = spec
        self.mode = mode
        self.batch_timeout_s = batch_timeout_s if mode == "process" else None  # a thread cannot be killed
        self.info: ModelInfo | None = None
        self.restarts = 0
        self._obs: WorkerObserver = observer or NoObserver()
        # SimpleQueue: its put wakes a waiting replica without a Condition (a fifth of the hand-off's cost)
        self._jobs: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self._lock = threading.RLock()  # the summary state, info, restarts; submitting against failing
        self._machine = StateMachine(on_change=self._changed)

        policy = restarts or RestartPolicy()

        def make_backend(index: int) -> Backend:
            if mode == "thread":
                from service.runtime.workers.backend_thread import ThreadBackend

                return (backend or ThreadBackend)(spec, f"qtrel-model-{index}")
            return (backend or ProcessBackend)(self.spec_for(index), f"qtrel-model-{index}")

        self._replicas = [
            Replica(i, make_backend, self._jobs, self._replica_changed, self._loaded, self._restarted, policy)
            for i in range(replicas)
        ]
        self._watchdog = (
            threading.Thread(target=self._watch, name="qtrel-watchdog", daemon=True) if self.batch_timeout_s else None
        )

    # --- what others may read -----------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._machine.state

    @property
    def error(self) -> str | None:
        return next((r.error for r in self._replicas if r.error), None)

    @property
    def size(self) -> int:
        return len(self._replicas)

    @property
    def pids(self) -> list[int]:
        return [pid for r in self._replicas if r.backend is not None and (pid := r.backend.pid) is not None]

    def alive(self) -> bool:
        """Liveness: a replica thread runs (or the model still loads), no model process is in a crash loop
        and none has failed for good."""
        if any(r.crash_looping or r.state == State.FAILED for r in self._replicas):
            return False
        return any(r.thread.is_alive() for r in self._replicas) or self.state == State.LOADING

    def crash_loops(self) -> list[int]:
        """The replicas whose model process restarted `crash_loop` times within the policy's window."""
        return [r.index for r in self._replicas if r.crash_looping]

    def describe(self) -> dict:
        return {
            "mode": self.mode,
            "replicas": self.size,
            "threads": self.spec.threads,
            "restarts": self.restarts,
            "replica_states": [r.state.value for r in self._replicas],
            "pids": self.pids,
            "batch_timeout_s": self.batch_timeout_s,
        }

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        for r in self._replicas:
            r.thread.start()
        if self._watchdog:
            self._watchdog.start()

    async def wait_ready(self) -> None:
        await asyncio.to_thread(self._machine.wait_for, {State.READY, State.FAILED, *ENDING})

    def stop(self) -> None:
        with self._lock:
            self._machine.advance(State.STOPPING)
        for r in self._replicas:
            r.request_stop()
        self._jobs.put(None)
        for t in [r.thread for r in self._replicas] + ([self._watchdog] if self._watchdog else []):
            if t.is_alive():
                t.join(timeout=15)
        for r in self._replicas:
            r.close()
        self._fail_queued("stopped")
        self._machine.advance(State.STOPPED)

    # --- jobs ---------------------------------------------------------------------------------
    def _submit(self, message: Forward | Job) -> asyncio.Future:
        # Jobs are taken while a crashed model process restarts: they wait for a live one.
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self.state not in (State.READY, State.RESTARTING):
                raise NotReady(self.state.value)
            self._jobs.put(Pending(message, fut, loop))
        return fut

    def _forward(self, message: Forward) -> asyncio.Future:
        """A free model process's exchange driven by the loop itself; else the job queued for a replica thread
        (a thread-mode model, every process busy or restarting)."""
        with self._lock:
            if self.state not in (State.READY, State.RESTARTING):
                raise NotReady(self.state.value)
        for r in self._replicas:
            if r.take():
                return r.drive(asyncio.get_running_loop(), message)
        return self._submit(message)

    async def run(self, batch: Sequence[Encoded]) -> list[bytes | BackendError]:
        """Forward one batch on a model: one entry per pair, its row (model.levels.pack_row: its scores as
        bytes), or the error of a pair that failed alone. A batch whose process died is retried once; one that
        fails again, or that the model raised for, is split in halves and each is tried once more, down to the
        single pair that fails."""
        return await self._isolating(list(batch), retry=True)

    async def _isolating(self, batch: list[Encoded], retry: bool) -> list[bytes | BackendError]:
        failure: ProcessDied | ModelError
        try:
            rows, seconds = await self._forward(Forward(batch))
        except ProcessDied as e:
            if retry:
                self._obs.batch_retried()
                log.warning("retrying a batch of %d pairs: %s", len(batch), e)
                return await self._isolating(batch, retry=False)
            failure = e
        except ModelError as e:
            failure = e
        except Exception:  # not ready, stopping: nothing to isolate
            self._obs.batch_failed("error")
            raise
        else:
            self._obs.forwarded(seconds)
            return [*split_rows(rows, len(batch))]
        reason = "process_died" if isinstance(failure, ProcessDied) else "error"
        if len(batch) == 1:
            self._obs.batch_failed(reason)
            return [failure]
        self._obs.batch_split(reason)
        log.warning("splitting a failed batch of %d pairs to isolate the failing pair: %s", len(batch), failure)
        mid = len(batch) // 2
        left, right = await asyncio.gather(self._isolating(batch[:mid], False), self._isolating(batch[mid:], False))
        return left + right

    async def job(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The named job `name` (service.runtime.workers.runner.JOBS) run on a model between batches; arguments
        and result must pickle."""
        return await self._submit(Job(name, args, kwargs))

    # --- the replicas' callbacks and the watchdog ---------------------------------------------
    def _summary(self) -> State:
        current = self._machine.state
        if current in ENDING:
            return current
        states = [r.state for r in self._replicas]
        if State.FAILED in states and State.READY not in states:  # a model that could never be brought up
            return State.FAILED
        serving = current in (State.READY, State.RESTARTING)
        if serving or all(s in (State.READY, State.RESTARTING, State.FAILED) for s in states):
            if State.READY in states:  # ready while one model process is
                return State.READY
            if serving:
                return State.RESTARTING
        return State.LOADING if State.LOADING in states else State.WARMING

    def _replica_changed(self) -> None:
        with self._lock:
            self._machine.advance(self._summary())

    def _changed(self, old: State, new: State) -> None:
        if new == State.FAILED:
            log.error("model failed to load: %s", self.error)
            self._fail_queued(self.error or "failed")

    def _fail_queued(self, why: str) -> None:
        """Fail every job still queued: no model will serve it."""
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._jobs.put(None)
                return
            if item.taken():
                item.settle(error=NotReady(why))

    @property
    def start_spec(self) -> LoadSpec:
        """The spec a model process starts with: the worker's, its `auto` inference pinned to what the first
        model process chose once one has (a restart after a crash is back seconds sooner, without OpenVINO's
        export and a second probe)."""
        with self._lock:
            chosen = self.info.details.get("inference") if self.info is not None else None
        if self.spec.inference == "auto" and chosen in ("torch", "openvino"):
            return replace(self.spec, inference=chosen)
        return self.spec

    def spec_for(self, index: int) -> LoadSpec:
        """`start_spec`, but with `auto` only the first model process probes: the others wait for its choice.
        Two engines' scores differ in the last bits (bfloat16: ~0.005 on a score), and a pair must score the
        same whichever process takes it. Should the first never load, the others probe for themselves."""
        if self.spec.inference == "auto" and index > 0:
            first = self._replicas[0]
            while self.info is None and first.state not in (State.FAILED, *ENDING):
                if self._machine.wait_for(ENDING, 0.05) in ENDING:
                    break
        return self.start_spec

    def _loaded(self, described: dict) -> None:
        with self._lock:
            if self.info is None:
                tok = PairTokenizer.from_dir(Path(self.spec.model_dir), max_length=described["max_length"])
                self.info = ModelInfo.of(described, tok)

    def _restarted(self, reason: str) -> None:
        with self._lock:
            self.restarts += 1
        self._obs.restarted(reason)

    def _watch(self) -> None:
        """Kill a model process that has held one job longer than batch_timeout_s; its replica then
        restarts it, as after a crash."""
        assert self.batch_timeout_s
        limit = self.batch_timeout_s
        while self._machine.wait_for(ENDING, min(0.25, limit / 4)) not in ENDING:
            now = time.monotonic()
            for r in self._replicas:
                backend = r.backend
                held = backend.in_flight() if backend is not None else None
                if held is None or backend is None or (seconds := now - held.since) <= limit:
                    continue
                if backend.kill("timeout", held):
                    log.error(
                        "model process %d (pid %d) held %s for %.1fs, over batch_timeout_s=%gs: killed",
                        r.index,
                        held.pid,
                        held.kind,
                        seconds,
                        limit,
                    )
