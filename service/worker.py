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
    logits: list[float]
    probs: list[float]
    best: int  # index of the most probable level


@dataclass(frozen=True)
class LoadSpec:
    """What to load and how: picklable, so that a child process can load it."""

    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    max_length: int = 128
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    warmup: bool = True


@dataclass(frozen=True)
class ModelInfo:
    """What the server process knows of the model: metadata and the tokenizer, no weights."""

    name: str
    labels: list[str]
    max_length: int
    device: str
    dtype: str
    tokenizer: PairTokenizer


Encoded = tuple[list[int], list[int]]  # (input_ids, token_type_ids) of one pair


def load_model(spec: LoadSpec) -> RelevanceModel:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    t0 = time.perf_counter()
    m = RelevanceModel.load(spec.model_dir, device=str(resolve_device(spec.device)), dtype=spec.dtype,
                            max_length=spec.max_length)
    log.info("loaded %s on %s/%s in %.2fs", spec.model_dir, m.device, m.dtype, time.perf_counter() - t0)
    return m


def warm(model: RelevanceModel) -> None:
    """Forward passes over a spread of lengths and batch sizes: first-call allocations and kernel
    selection happen here, not on a user's request."""
    vocab = min(model.tokenizer.vocab_size, model.cfg.vocab_size)
    for length in sorted({8, 32, model.max_length}):
        for size in (1, 8):
            ids = [[model.tokenizer.cls_id] + [1000 % vocab] * (length - 2) + [model.tokenizer.sep_id]] * size
            model.logits(ids, [[0] * length] * size)


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


def forward_batch(model: RelevanceModel, batch: Sequence[Encoded]) -> tuple[list[list[float]], list[list[float]], list[int], float]:
    """(logits, probs, best level index, seconds) for one batch, as plain lists (cheap to pickle)."""
    t0 = time.perf_counter()
    logits = forward_in_halves(lambda b: model.logits([x[0] for x in b], [x[1] for x in b]), batch)
    seconds = time.perf_counter() - t0
    probs = logits.softmax(-1)
    return logits.tolist(), probs.tolist(), probs.argmax(-1).tolist(), seconds


def info_of(model: RelevanceModel) -> dict:
    return {"name": model.name, "labels": list(model.labels), "max_length": model.max_length,
            "device": str(model.device), "dtype": model.dtype}


# --- the model process -------------------------------------------------------------------------
def _child_main(conn, spec: LoadSpec) -> None:
    """Entry point of the model process: load, warm, then answer jobs until told to stop or the
    server process goes away. Lifecycle signals are the server's to handle (it drains first)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        model = load_model(spec)
        conn.send(("loaded", info_of(model)))
        if spec.warmup:
            t0 = time.perf_counter()
            warm(model)
            log.info("warm-up done in %.2fs", time.perf_counter() - t0)
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
            if kind == "forward":
                out = forward_batch(model, payload)
            else:
                fn, args, kwargs = payload
                out = fn(model, *args, **kwargs)
            conn.send(("ok", out))
        except Exception as e:  # reported to the caller of this job only
            conn.send(("error", (type(e).__name__, str(e))))


class Worker:
    """Runs jobs on the model, one at a time, in a child process or on a thread (see the module doc).

    The event loop hands jobs over with `run` (a batch) and `call` (any function of the model, e.g.
    an explanation); a thread of this process feeds them to the model in order.
    """

    def __init__(self, spec: LoadSpec, mode: str = "process", on_batch=None, on_restart=None):
        if mode not in ("process", "thread"):
            raise ValueError(f"worker mode must be 'process' or 'thread', got {mode!r}")
        self.spec = spec
        self.mode = mode
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="qtrel-worker", daemon=True)
        self.state = WorkerState.LOADING
        self.error: str | None = None
        self.info: ModelInfo | None = None
        self.model: RelevanceModel | None = None  # thread mode only; None in process mode
        self.restarts = 0
        self._ready = threading.Event()
        self._stopping = False
        self._proc = None
        self._conn = None
        self._on_batch = on_batch  # callback(seconds) per forward, for metrics
        self._on_restart = on_restart  # callback() when the model process had to be restarted

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() or self.state == WorkerState.LOADING

    @property
    def pid(self) -> int | None:
        """The model process's pid (process mode)."""
        return self._proc.pid if self._proc is not None else None

    async def wait_ready(self) -> None:
        await asyncio.to_thread(self._ready.wait)

    def _submit(self, kind: str, payload) -> cf.Future:
        # Jobs are taken while a crashed model process restarts: they wait for the new one.
        if self.state not in (WorkerState.READY, WorkerState.RESTARTING):
            raise RuntimeError(f"model is not ready ({self.state.value})")
        fut: cf.Future = cf.Future()
        self._jobs.put((kind, payload, fut))
        return fut

    async def run(self, batch: list[Encoded]) -> list[PairOutput]:
        """Forward one batch on the model; the event loop only awaits."""
        logits, probs, best, seconds = await asyncio.wrap_future(self._submit("forward", batch))
        if self._on_batch:
            self._on_batch(seconds)
        return [PairOutput(lg, pr, b) for lg, pr, b in zip(logits, probs, best)]

    async def call(self, fn: Callable, *args, **kwargs):
        """`fn(model, *args, **kwargs)` on the model, between batches (e.g. an explanation). In process
        mode `fn` must be picklable (a module-level function) and so must its arguments and result."""
        return await asyncio.wrap_future(self._submit("call", (fn, args, kwargs)))

    def stop(self) -> None:
        self._stopping = True
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=15)
        self._close_child()
        self.state = WorkerState.STOPPED

    # --- on the worker thread ----------------------------------------------------------------
    def _main(self) -> None:
        try:
            if self.mode == "thread":
                self._serve_local()
            else:
                self._serve_remote()
        finally:
            self._ready.set()

    def _fail(self, error: str) -> None:
        self.state = WorkerState.FAILED
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

    def _next_job(self):
        """The next job whose caller still waits, or None to stop."""
        while True:
            job = self._jobs.get()
            if job is None or job[2].set_running_or_notify_cancel():
                return job

    def _serve_local(self) -> None:
        try:
            model = load_model(self.spec)
            self.model = model
            self.info = ModelInfo(tokenizer=model.tokenizer, **info_of(model))
            if self.spec.warmup:
                self.state = WorkerState.WARMING
                t0 = time.perf_counter()
                warm(model)
                log.info("warm-up done in %.2fs", time.perf_counter() - t0)
        except Exception as e:
            log.error("model failed to load", exc_info=e)
            self._fail(f"{type(e).__name__}: {e}")
            return
        self.state = WorkerState.READY
        self._ready.set()
        while (job := self._next_job()) is not None:
            kind, payload, fut = job
            try:
                if kind == "forward":
                    fut.set_result(forward_batch(model, payload))
                else:
                    fn, args, kwargs = payload
                    fut.set_result(fn(model, *args, **kwargs))
            except BaseException as e:  # reported to the caller of this job only
                fut.set_exception(e)

    def _spawn(self) -> str | None:
        """Start a model process and wait until it is warm; the error text if it failed to load."""
        ctx = mp.get_context("spawn")  # never fork a process that already runs threads
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_main, args=(child, self.spec), name="qtrel-model", daemon=True)
        proc.start()
        child.close()  # so that the child's death reads as EOF here
        self._proc, self._conn = proc, parent
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
                if self.info is None:
                    tok = PairTokenizer.from_dir(Path(self.spec.model_dir), max_length=payload["max_length"])
                    self.info = ModelInfo(tokenizer=tok, **payload)
                if self.state == WorkerState.LOADING:
                    self.state = WorkerState.WARMING
            elif kind == "ready":
                return None

    def _close_child(self) -> None:
        proc, conn = self._proc, self._conn
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
        log.error("model process died (%s); restarting it", why)
        self.state = WorkerState.RESTARTING
        self.restarts += 1
        if self._on_restart:
            self._on_restart()
        self._close_child()
        error = self._spawn()
        if error:
            self._fail(error)
            return False
        self.state = WorkerState.READY
        log.info("model process restarted (pid %s)", self.pid)
        return True

    def _serve_remote(self) -> None:
        try:
            error = self._spawn()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if error:
            self._fail(error)
            return
        self.state = WorkerState.READY
        self._ready.set()
        log.info("model process ready (pid %s)", self.pid)
        while not self._stopping:
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:  # idle: notice a dead model process before a request does
                if not self._stopping and not self._proc.is_alive() and not self._restart(
                        f"exit code {self._proc.exitcode}"):
                    return
                continue
            if job is None:
                return
            kind, payload, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            if not self._proc.is_alive() and not self._restart(f"exit code {self._proc.exitcode}"):
                fut.set_exception(RuntimeError(f"model is not ready ({self.error})"))
                return
            try:
                self._conn.send((kind, payload))
                status, out = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError) as e:
                self._proc.join(1)
                fut.set_exception(WorkerCrashed(f"the model process died during this batch "
                                                f"(exit code {self._proc.exitcode})"))
                if self._stopping or not self._restart(f"{type(e).__name__}, exit code {self._proc.exitcode}"):
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
