"""The worker: one thread that alone owns the model and the device.

It loads the model, warms it up over representative shapes, then runs forward passes handed to it,
one batch at a time, off the event loop. A failed forward fails only its batch; an out-of-memory
error on a GPU retries the batch in halves.
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
from enum import Enum

import torch

from model.classifier import RelevanceModel

log = logging.getLogger("qtrel.worker")


class WorkerState(str, Enum):
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class PairOutput:
    logits: list[float]
    probs: list[float]
    best: int  # index of the most probable level


Encoded = tuple[list[int], list[int]]  # (input_ids, token_type_ids) of one pair


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


class Worker:
    def __init__(self, load: Callable[[], RelevanceModel], warmup: bool = True, on_batch=None):
        self._load = load
        self._warmup = warmup
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="qtrel-worker", daemon=True)
        self.state = WorkerState.LOADING
        self.error: str | None = None
        self.model: RelevanceModel | None = None  # read-only outside the worker thread (metadata)
        self._ready = threading.Event()
        self._on_batch = on_batch  # callback(seconds) per forward, for metrics

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() or self.state == WorkerState.LOADING

    async def wait_ready(self) -> None:
        await asyncio.to_thread(self._ready.wait)

    async def run(self, batch: list[Encoded]) -> list[PairOutput]:
        """Forward one batch on the worker thread; the event loop only awaits."""
        if self.state != WorkerState.READY:
            raise RuntimeError(f"model is not ready ({self.state.value})")
        fut: cf.Future = cf.Future()
        self._jobs.put((self._forward_job, batch, fut))
        return await asyncio.wrap_future(fut)

    async def call(self, fn: Callable[[RelevanceModel], object]):
        """Run `fn(model)` on the worker thread, between batches (e.g. an explanation)."""
        if self.state != WorkerState.READY:
            raise RuntimeError(f"model is not ready ({self.state.value})")
        fut: cf.Future = cf.Future()
        self._jobs.put((lambda m: fn(m), None, fut))
        return await asyncio.wrap_future(fut)

    def stop(self) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.state = WorkerState.STOPPED

    # --- on the worker thread ----------------------------------------------------------------
    def _forward_job(self, model: RelevanceModel, batch: list[Encoded]) -> list[PairOutput]:
        t0 = time.perf_counter()
        logits = forward_in_halves(lambda b: model.logits([x[0] for x in b], [x[1] for x in b]), batch)
        if self._on_batch:
            self._on_batch(time.perf_counter() - t0)
        probs = logits.softmax(-1)
        return [PairOutput(lg, pr, b) for lg, pr, b in zip(logits.tolist(), probs.tolist(), probs.argmax(-1).tolist())]

    def _warm(self, model: RelevanceModel) -> None:
        """Forward passes over a spread of lengths and batch sizes: first-call allocations and
        kernel selection happen here, not on a user's request."""
        vocab = min(model.tokenizer.vocab_size, model.cfg.vocab_size)
        for length in sorted({8, 32, model.max_length}):
            for size in (1, 8):
                ids = [[model.tokenizer.cls_id] + [1000 % vocab] * (length - 2) + [model.tokenizer.sep_id]] * size
                model.logits(ids, [[0] * length] * size)

    def _main(self) -> None:
        try:
            model = self._load()
            self.model = model
            if self._warmup:
                self.state = WorkerState.WARMING
                t0 = time.perf_counter()
                self._warm(model)
                log.info("warm-up done in %.2fs", time.perf_counter() - t0)
            self.state = WorkerState.READY
        except Exception as e:
            self.state = WorkerState.FAILED
            self.error = f"{type(e).__name__}: {e}"
            log.error("model failed to load: %s", self.error, exc_info=e)
            return
        finally:
            self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, batch, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(model, batch) if batch is not None else fn(model))
            except BaseException as e:  # reported to the caller of this batch only
                fut.set_exception(e)
