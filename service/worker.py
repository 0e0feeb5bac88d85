"""The worker: the one owner of the model instances.

It runs `replicas` backends (`service.backend`), each driven by one replica thread that takes the next
job from one shared queue when its model is free, so a model is never used by two callers at once. The
event loop hands jobs over with `run` (a batch) and `job` (a named extra job, e.g. "explain") and only
awaits. State lives in one place per part: each replica's `StateMachine`, and the worker's, which
summarises them (loading, warming, ready, restarting, failed, stopping, stopped).

Faults: an error the model raises fails only its job. A model process that dies, or that the watchdog
kills because it held one job longer than `batch_timeout_s` (stuck, or stopped), is restarted by its
replica while the others keep serving; a batch it held is retried once on a live process (a second
death fails it: a poison batch). If a model cannot be loaded, the worker is `failed`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.classifier import RelevanceModel
from model.tokenizer import PairTokenizer
from service.backend import (
    Backend,
    Encoded,
    Forward,
    Job,
    LoadFailed,
    LoadSpec,
    NotReady,
    ProcessDied,
    State,
    StateMachine,
)
from service.backend_process import ProcessBackend
from service.backend_thread import ThreadBackend
from service.worker_api import ModelInfo, NoObserver, PairOutput, WorkerObserver

__all__ = ["ModelInfo", "PairOutput", "Worker", "WorkerObserver"]

log = logging.getLogger("qtrel.worker")

ENDING = frozenset({State.STOPPING, State.STOPPED})


@dataclass(eq=False)
class Pending:
    message: Forward | Job
    future: cf.Future


class Replica:
    """One backend and the thread that alone drives it: start it, serve jobs from the shared queue,
    restart it when its process dies. It reports to its worker only through the callbacks it is given."""

    def __init__(
        self,
        index: int,
        make_backend: Callable[[int], Backend],
        jobs: queue.Queue,
        on_change: Callable[[], None],
        on_loaded: Callable[[dict], None],
        on_restart: Callable[[str], None],
    ):
        self.index = index
        self.error: str | None = None  # why the model could not be (re)loaded
        self.machine = StateMachine(on_change=lambda old, new: on_change())
        self.thread = threading.Thread(target=self._main, name=f"qtrel-worker-{index}", daemon=True)
        self._make_backend = make_backend
        self._jobs = jobs
        self._on_loaded = on_loaded
        self._on_restart = on_restart
        self._backend: Backend | None = None

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def backend(self) -> Backend | None:
        return self._backend

    def request_stop(self) -> None:
        self.machine.advance(State.STOPPING)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        self.machine.advance(State.STOPPED)

    def _start_backend(self, restarting: bool) -> bool:
        """Load and warm up a new backend; False if it failed (the replica is then `failed`) or stop began."""
        self._backend = backend = self._make_backend(self.index)
        try:
            self._on_loaded(backend.load())
            if not restarting:
                self.machine.advance(State.WARMING)
            if self.machine.ending:
                return False
            backend.warm_up()
        except LoadFailed as e:
            self.error = str(e)
            self.machine.advance(State.FAILED)
            return False
        if not self.machine.advance(State.READY):
            return False
        log.info("model %d %s (pid %s)", self.index, "restarted" if restarting else "ready", backend.pid)
        return True

    def _restart(self, reason: str, detail: str) -> bool:
        if self.machine.ending or not self.machine.advance(State.RESTARTING):
            return False
        log.error(
            "model process %d %s (%s); restarting it",
            self.index,
            "timed out" if reason == "timeout" else "died",
            detail,
        )
        self._on_restart(reason)
        if self._backend is not None:
            self._backend.close()
        return self._start_backend(restarting=True)

    def _restart_if_dead(self) -> bool:
        """False if the model process is dead and could not be replaced."""
        assert self._backend is not None
        health = self._backend.health()
        return health.alive or self._restart("died", health.detail)

    def _main(self) -> None:
        if not self._start_backend(restarting=False):
            return
        while not self.machine.ending:
            try:
                item = self._jobs.get(timeout=0.5)
            except queue.Empty:  # idle: notice a dead model process before a request does
                if not self._restart_if_dead():
                    return
                continue
            if item is None:
                self._jobs.put(None)  # the other replicas stop too
                return
            if not item.future.set_running_or_notify_cancel():
                continue
            if not self._restart_if_dead():
                item.future.set_exception(NotReady(self.error or self.state.value))
                return
            try:
                item.future.set_result(self._execute(item.message))
            except ProcessDied as e:
                item.future.set_exception(e)
                if not self._restart(e.reason, str(e)):
                    return
            except Exception as e:  # this job only
                item.future.set_exception(e)

    def _execute(self, message: Forward | Job) -> Any:
        assert self._backend is not None
        if isinstance(message, Forward):
            return self._backend.forward(message.batch)
        return self._backend.job(message.name, message.args, message.kwargs)


class Worker:
    """Runs jobs on `replicas` model instances: child processes (`mode="process"`) or one model on a
    thread of this process (`mode="thread"`). See the module doc."""

    def __init__(
        self,
        spec: LoadSpec,
        mode: str = "process",
        replicas: int = 1,
        observer: WorkerObserver | None = None,
        batch_timeout_s: float | None = None,
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
        self._jobs: queue.Queue[Pending | None] = queue.Queue()
        self._lock = threading.RLock()  # the summary state, info, restarts; submitting against failing
        self._machine = StateMachine(on_change=self._changed)

        def make_backend(index: int) -> Backend:
            return ThreadBackend(spec) if mode == "thread" else ProcessBackend(spec, f"qtrel-model-{index}")

        self._replicas = [
            Replica(i, make_backend, self._jobs, self._replica_changed, self._loaded, self._restarted)
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

    @property
    def model(self) -> RelevanceModel | None:
        """The model object in thread mode (for fault-injection tests); None in process mode."""
        b = self._replicas[0].backend
        return b.model if isinstance(b, ThreadBackend) else None

    def alive(self) -> bool:
        return any(r.thread.is_alive() for r in self._replicas) or self.state == State.LOADING

    def describe(self) -> dict:
        return {
            "mode": self.mode,
            "replicas": self.size,
            "threads": self.spec.threads,
            "restarts": self.restarts,
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
    def _submit(self, message: Forward | Job) -> cf.Future:
        # Jobs are taken while a crashed model process restarts: they wait for a live one.
        with self._lock:
            if self.state not in (State.READY, State.RESTARTING):
                raise NotReady(self.state.value)
            fut: cf.Future = cf.Future()
            self._jobs.put(Pending(message, fut))
        return fut

    async def run(self, batch: Sequence[Encoded]) -> list[PairOutput]:
        """Forward one batch on a model; retried once if its model process died meanwhile."""
        message = Forward(list(batch))
        try:
            try:
                scores = await asyncio.wrap_future(self._submit(message))
            except ProcessDied as e:
                self._obs.batch_retried()
                log.warning("retrying a batch of %d pairs: %s", len(batch), e)
                scores = await asyncio.wrap_future(self._submit(message))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._obs.batch_failed("process_died" if isinstance(e, ProcessDied) else "error")
            raise
        self._obs.forwarded(scores.seconds)
        return [PairOutput(*row) for row in zip(scores.logits, scores.probs, scores.level, scores.expected)]

    async def job(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The named job `name` (service.runner.JOBS, or the spec's jobs) run on a model between batches;
        arguments and result must pickle."""
        return await asyncio.wrap_future(self._submit(Job(name, args, kwargs)))

    # --- the replicas' callbacks and the watchdog ---------------------------------------------
    def _summary(self) -> State:
        current = self._machine.state
        if current in ENDING:
            return current
        states = [r.state for r in self._replicas]
        if State.FAILED in states:
            return State.FAILED
        if current in (State.READY, State.RESTARTING):  # serving while at least one replica is up
            return State.READY if State.READY in states else State.RESTARTING
        if all(s == State.READY for s in states):
            return State.READY
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
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(NotReady(why))

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
                if (
                    held is not None
                    and now - held.since > limit
                    and backend is not None
                    and backend.kill("timeout", held)
                ):
                    log.error(
                        "model process %d (pid %d) held %s for %.1fs, over batch_timeout_s=%gs: killed",
                        r.index,
                        held.pid,
                        held.kind,
                        now - held.since,
                        limit,
                    )
