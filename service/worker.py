"""The worker: the one place that owns the model and the device.

It loads the model, warms it up over representative shapes, then runs forward passes handed to it,
one batch at a time, off the event loop. A failed forward fails only its batch; an out-of-memory
error on a GPU retries the batch in halves.

Two modes, the same contract:
- `process` (the default): the model lives in a child process. The server's event loop, its
  tokeniser thread and the forward pass then never take turns on one GIL: on a 2-core machine a
  forward run on a thread beside a busy event loop waits on the GIL between every torch op and ran
  at about half speed (docs/design.md). Batches travel over a pipe as token ids (a few KB). If the
  child dies (a segfault, the OOM killer), only the batch it held fails; a new child is started and
  readiness is 503 until it is warm.
- `thread`: the model lives on a thread of the server process (for debugging and fault-injection tests).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import ctypes
import gc
import logging
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

from model.classifier import RelevanceModel, resolve_device
from model.tokenizer import PairTokenizer

log = logging.getLogger("qtrel.worker")


class WorkerState(str, Enum):
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class WorkerCrashed(RuntimeError):
    """The model process died while it held a batch."""


class RemoteError(RuntimeError):
    """An exception raised in the model process, re-raised here by type name and message."""


@dataclass
class PairOutput:
    """One pair's row of a `model.scoring.ScoredBatch`, as plain numbers (cheap to pickle)."""

    logits: list[float]
    probs: list[float]
    level: int  # class index chosen by the model's level rule
    expected: float  # expected level: the ranking score


@dataclass(frozen=True)
class LoadSpec:
    """What to load and how: picklable, so that a child process can load it."""

    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    max_length: int = 128
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    warmup: bool = True
    max_batch_tokens: int = 8192  # the largest batch warm-up prepares for


@dataclass(frozen=True)
class ModelInfo:
    """What the server process knows of the model: metadata and the tokenizer, no weights."""

    name: str
    labels: list[str]
    max_length: int
    device: str
    dtype: str
    tokenizer: PairTokenizer
    details: dict  # RelevanceModel.describe(): everything /info shows about the model

    @classmethod
    def of(cls, described: dict, tokenizer: PairTokenizer) -> ModelInfo:
        keys = ("name", "labels", "max_length", "device", "dtype")
        return cls(**{k: described[k] for k in keys}, tokenizer=tokenizer, details=described)


Encoded = tuple[list[int], list[int]]  # (input_ids, token_type_ids) of one pair


def quiet_gc() -> None:
    """For a process that is qtrel's alone, after start-up: move every object alive now (torch, the
    app, the model) out of the cyclic garbage collector's sight, and collect the youngest generation
    less often. Full collections otherwise rescan hundreds of thousands of start-up objects while
    requests wait; this was worth 8-17% more one-pair requests per second (docs/design.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def release_free_memory() -> None:
    """Hand memory freed by the warm-up back to the OS (glibc keeps it otherwise): warming every kernel
    shape up to 8192 tokens peaks at ~830 MB per model process, ~450 MB after this."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_model(spec: LoadSpec) -> RelevanceModel:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    t0 = time.perf_counter()
    m = RelevanceModel.load(spec.model_dir, device=str(resolve_device(spec.device)), dtype=spec.dtype,
                            max_length=spec.max_length)
    log.info("loaded %s on %s/%s in %.2fs", spec.model_dir, m.device, m.dtype, time.perf_counter() - t0)
    return m


def start_model(spec: LoadSpec, loaded: Callable[[RelevanceModel], None]) -> RelevanceModel:
    """Load the model, tell `loaded`, then warm it up (if the spec says so): the start of either mode."""
    model = load_model(spec)
    loaded(model)
    if spec.warmup:
        t0 = time.perf_counter()
        model.warm_up(spec.max_batch_tokens)
        log.info("warm-up done in %.2fs", time.perf_counter() - t0)
    return model


def forward_in_halves(forward: Callable[[Sequence[Encoded]], torch.Tensor], batch: Sequence[Encoded]) -> torch.Tensor:
    """Run `forward`; on a CUDA out-of-memory error split the batch in two and retry each half."""
    try:
        return forward(batch)
    except torch.cuda.OutOfMemoryError:
        if len(batch) == 1:
            raise
        torch.cuda.empty_cache()
        mid = len(batch) // 2
        log.warning("out of memory on %d pairs; retrying in halves", len(batch))
        return torch.cat([forward_in_halves(forward, batch[:mid]), forward_in_halves(forward, batch[mid:])])


Forwarded = tuple[list[list[float]], list[list[float]], list[int], list[float], float]


def forward_batch(model: RelevanceModel, batch: Sequence[Encoded]) -> Forwarded:
    """(logits, probs, level index, expected level, seconds) for one batch, as plain lists (cheap to
    pickle); the scores come from the model's one scoring call."""
    t0 = time.perf_counter()
    logits = forward_in_halves(lambda b: model.logits([x[0] for x in b], [x[1] for x in b]), batch)
    seconds = time.perf_counter() - t0
    s = model.score(logits)
    return s.logits.tolist(), s.probs.tolist(), s.level.tolist(), s.expected.tolist(), seconds


def info_of(model: RelevanceModel) -> dict:
    return model.describe()


# --- the model process -------------------------------------------------------------------------
def _child_main(conn, spec: LoadSpec) -> None:
    """Entry point of the model process: load, warm, then answer jobs until told to stop or the
    server process goes away. Lifecycle signals are the server's to handle (it drains first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model = start_model(spec, lambda m: conn.send(("loaded", info_of(m))))
        quiet_gc()
        release_free_memory()
        conn.send(("ready", None))
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return  # the server process is gone
        if job is None:
            return
        kind, payload = job
        try:
            conn.send(("ok", run_job(model, kind, payload)))
        except Exception as e:  # reported to the caller of this job only
            conn.send(("error", (type(e).__name__, str(e))))


def run_job(model: RelevanceModel, kind: str, payload):
    if kind == "forward":
        return forward_batch(model, payload)
    fn, args, kwargs = payload
    return fn(model, *args, **kwargs)


class _Replica:
    """One model process and the thread of this process that feeds it jobs from the shared queue."""

    def __init__(self, worker: Worker, index: int):
        self.worker = worker
        self.index = index
        self.state = WorkerState.LOADING
        self.proc = None
        self.conn = None
        self.thread = threading.Thread(target=self._main, name=f"qtrel-worker-{index}", daemon=True)

    def _spawn(self) -> str | None:
        """Start a model process and wait until it is warm; the error text if it failed to load."""
        try:
            return self._start_process()
        except Exception as e:  # e.g. no memory left to start a process
            return f"{type(e).__name__}: {e}"

    def _start_process(self) -> str | None:
        ctx = mp.get_context("spawn")  # never fork a process that already runs threads
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(child, self.worker.spec), name=f"qtrel-model-{self.index}",
                           daemon=True)
        proc.start()
        child.close()  # so that the child's death reads as EOF here
        self.proc, self.conn = proc, parent
        while True:
            try:
                kind, payload = parent.recv()
            except (EOFError, OSError):
                proc.join(5)
                return f"the model process exited while loading (exit code {proc.exitcode})"
            if kind == "failed":
                proc.join(5)
                return payload
            if kind == "loaded":
                self.worker._loaded(payload)
                if self.state == WorkerState.LOADING:
                    self.state = WorkerState.WARMING
            elif kind == "ready":
                return None

    def close(self) -> None:
        proc, conn = self.proc, self.conn
        if proc is None:
            return
        try:
            if proc.is_alive() and conn is not None:
                conn.send(None)
        except (OSError, ValueError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if conn is not None:
            conn.close()

    def _restart(self, why: str) -> bool:
        log.error("model process %d died (%s); restarting it", self.index, why)
        self.state = WorkerState.RESTARTING
        self.worker._restarted()
        self.close()
        error = self._spawn()
        if error:
            self.state = WorkerState.FAILED
            self.worker._fail(error)
            return False
        self.state = WorkerState.READY
        log.info("model process %d restarted (pid %s)", self.index, self.proc.pid)
        return True

    def _main(self) -> None:
        w = self.worker
        error = self._spawn()
        if error:
            self.state = WorkerState.FAILED
            w._fail(error)
            return
        self.state = WorkerState.READY
        w._replica_ready()
        log.info("model process %d ready (pid %s)", self.index, self.proc.pid)
        while not w._stopping:
            try:
                job = w._jobs.get(timeout=0.5)
            except queue.Empty:  # idle: notice a dead model process before a request does
                if not w._stopping and not self.proc.is_alive() and not self._restart(
                        f"exit code {self.proc.exitcode}"):
                    return
                continue
            if job is None:
                w._jobs.put(None)  # the other replicas stop too
                return
            kind, payload, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            if not self.proc.is_alive() and not self._restart(f"exit code {self.proc.exitcode}"):
                fut.set_exception(RuntimeError(f"model is not ready ({w.error})"))
                return
            try:
                self.conn.send((kind, payload))
                status, out = self.conn.recv()
            except (EOFError, OSError) as e:
                self.proc.join(1)
                fut.set_exception(WorkerCrashed(f"the model process died during this batch "
                                                f"(exit code {self.proc.exitcode})"))
                if w._stopping or not self._restart(f"{type(e).__name__}, exit code {self.proc.exitcode}"):
                    return
                continue
            except Exception as e:  # e.g. an argument that does not pickle: this job only
                fut.set_exception(e)
                continue
            if status == "ok":
                fut.set_result(out)
            else:
                name, message = out
                fut.set_exception(RemoteError(f"{name}: {message}"))


class Worker:
    """Runs jobs on the model, one at a time per replica, in child processes or on a thread (see the
    module doc). The event loop hands jobs over with `run` (a batch) and `call` (any function of the
    model, e.g. an explanation); each replica takes the next job from one shared queue when it is free.
    """

    def __init__(self, spec: LoadSpec, mode: str = "process", replicas: int = 1, on_batch=None, on_restart=None):
        if mode not in ("process", "thread"):
            raise ValueError(f"worker mode must be 'process' or 'thread', got {mode!r}")
        if replicas < 1 or (mode == "thread" and replicas != 1):
            raise ValueError(f"replicas must be >= 1 (exactly 1 in thread mode), got {replicas}")
        self.spec = spec
        self.mode = mode
        self._jobs: queue.Queue = queue.Queue()
        self._replicas = [_Replica(self, i) for i in range(replicas)] if mode == "process" else []
        self._thread = threading.Thread(target=self._serve_local, name="qtrel-worker", daemon=True) \
            if mode == "thread" else None
        self._local_state = WorkerState.LOADING
        self.error: str | None = None
        self.info: ModelInfo | None = None
        self.model: RelevanceModel | None = None  # thread mode only; None in process mode
        self.restarts = 0
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._n_ready = 0
        self._started = False  # every replica was ready once
        self._stopping = False
        self._stopped = False
        self._on_batch = on_batch  # callback(seconds) per forward, for metrics
        self._on_restart = on_restart  # callback() when a model process had to be restarted

    @property
    def replicas(self) -> int:
        return max(1, len(self._replicas))

    @property
    def state(self) -> WorkerState:
        if self._stopped:
            return WorkerState.STOPPED
        if self.error is not None:
            return WorkerState.FAILED
        if self.mode == "thread":
            return self._local_state
        states = [r.state for r in self._replicas]
        if self._started:  # serving while at least one replica is up
            return WorkerState.READY if WorkerState.READY in states else WorkerState.RESTARTING
        return WorkerState.LOADING if WorkerState.LOADING in states else WorkerState.WARMING

    def start(self) -> None:
        for r in self._replicas:
            r.thread.start()
        if self._thread:
            self._thread.start()

    def alive(self) -> bool:
        threads = [r.thread for r in self._replicas] or [self._thread]
        return any(t.is_alive() for t in threads) or self.state == WorkerState.LOADING

    @property
    def pids(self) -> list[int]:
        """The model processes' pids (process mode)."""
        return [r.proc.pid for r in self._replicas if r.proc is not None]

    async def wait_ready(self) -> None:
        await asyncio.to_thread(self._ready.wait)

    def _submit(self, kind: str, payload) -> cf.Future:
        # Jobs are taken while a crashed model process restarts: they wait for a live one.
        if self.state not in (WorkerState.READY, WorkerState.RESTARTING):
            raise RuntimeError(f"model is not ready ({self.state.value})")
        fut: cf.Future = cf.Future()
        self._jobs.put((kind, payload, fut))
        return fut

    async def run(self, batch: list[Encoded]) -> list[PairOutput]:
        """Forward one batch on the model; the event loop only awaits."""
        logits, probs, level, expected, seconds = await asyncio.wrap_future(self._submit("forward", batch))
        if self._on_batch:
            self._on_batch(seconds)
        return [PairOutput(*row) for row in zip(logits, probs, level, expected)]

    async def call(self, fn: Callable, *args, **kwargs):
        """`fn(model, *args, **kwargs)` on the model, between batches (e.g. an explanation). In process
        mode `fn` must be picklable (a module-level function) and so must its arguments and result."""
        return await asyncio.wrap_future(self._submit("call", (fn, args, kwargs)))

    def stop(self) -> None:
        self._stopping = True
        self._jobs.put(None)
        for t in [r.thread for r in self._replicas] + ([self._thread] if self._thread else []):
            if t.is_alive():
                t.join(timeout=15)
        for r in self._replicas:
            r.close()
        self._stopped = True

    # --- called from the replicas' threads -------------------------------------------------
    def _loaded(self, info: dict) -> None:
        with self._lock:
            if self.info is None:
                tok = PairTokenizer.from_dir(Path(self.spec.model_dir), max_length=info["max_length"])
                self.info = ModelInfo.of(info, tok)

    def _replica_ready(self) -> None:
        with self._lock:
            self._n_ready += 1
            if self._n_ready == len(self._replicas):
                self._started = True
                self._ready.set()

    def _restarted(self) -> None:
        with self._lock:
            self.restarts += 1
        if self._on_restart:
            self._on_restart()

    def _fail(self, error: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
                log.error("model failed to load: %s", error)
        self._ready.set()
        while True:  # anything still queued will not be served
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job[2].set_exception(RuntimeError(f"model is not ready ({error})"))
            else:
                self._jobs.put(None)
                return

    # --- thread mode -------------------------------------------------------------------------
    def _serve_local(self) -> None:
        def loaded(model: RelevanceModel) -> None:
            self.model = model
            self.info = ModelInfo.of(info_of(model), model.tokenizer)
            self._local_state = WorkerState.WARMING

        try:
            model = start_model(self.spec, loaded)
        except Exception as e:
            log.error("model failed to load", exc_info=e)
            self._fail(f"{type(e).__name__}: {e}")
            return
        self._local_state = WorkerState.READY
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, payload, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(run_job(model, kind, payload))
            except BaseException as e:  # reported to the caller of this job only
                fut.set_exception(e)
