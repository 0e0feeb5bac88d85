"""The engine joins tokenisation, the batcher and the worker behind the calls HTTP needs: score these
pairs, explain this pair, are you ready, describe yourself.

It is handed its parts by the composition root (`service.app`): the resolved runtime, the worker and
the batcher; it decides nothing about where or how the model runs. It owns the one readiness function
and the one drain switch. Tokenisation of larger requests runs on its own thread, so it overlaps with
forward passes in the model processes; the event loop only awaits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from model.tokenizer import EncodedPairs
from service.backend import BackendError, State
from service.batcher import Batcher, Closed, DeadlineExceeded, Overloaded
from service.errors import ErrorKind, ServiceError
from service.logs import request_id
from service.metrics import Metrics
from service.runtime import Runtime, package_version
from service.settings import Settings
from service.tracing import Tracing
from service.worker import ModelInfo, PairOutput, Worker

log = logging.getLogger("qtrel.engine")

# Requests with at most this many pairs are tokenised on the event loop (see Engine.score).
INLINE_PAIRS = 4


@dataclass
class Scored:
    outputs: list[PairOutput]
    enc: EncodedPairs
    labels: list[str]  # the model's levels, in class order
    model: str  # the model's name


@dataclass
class Tokenized:
    """Pairs as the model sees them, and what was cut (`/tokenize`): no forward pass."""

    enc: EncodedPairs
    tokens: list[list[str]]  # per pair, the text of each id
    query_tokens: list[list[str]]  # per pair, the query's and the title's word pieces before truncation
    title_tokens: list[list[str]]
    max_length: int
    model: str


class Engine:
    def __init__(
        self,
        settings: Settings,
        runtime: Runtime,
        worker: Worker,
        batcher: Batcher,
        metrics: Metrics,
        tracing: Tracing | None = None,
    ):
        self.settings = settings
        self.tracing = tracing or Tracing()  # off: every call a no-op
        self.runtime = runtime
        self.worker = worker
        self.batcher = batcher
        self.metrics = metrics
        self._draining = False
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="qtrel-tokenize")

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> str | None:
        """Load and warm up; None once serving, else why the model cannot be served (the caller exits)."""
        self.batcher.start()
        self.worker.start()
        await self.worker.wait_ready()
        if self.worker.state == State.READY:
            m = self._model()
            self.metrics.model_info.labels(m.name, str(m.device), m.dtype, package_version()).set(1)
            self.metrics.ready.set(1)
            return None
        if self.worker.state == State.FAILED:
            return f"model failed to load: {self.worker.error}"
        return None  # stopping before the model was up

    def readiness(self) -> tuple[bool, str]:
        """The one readiness rule: the model is loaded and warmed up, a model process serves, and the
        service is not draining. (ready, why) -- why is the state's name, or what failed."""
        if self._draining:
            return False, "draining"
        state = self.worker.state
        if state == State.FAILED:
            return False, f"model failed to load: {self.worker.error}"
        return state == State.READY, state.value

    def liveness(self) -> tuple[bool, str]:
        if loops := self.worker.crash_loops():
            return False, f"crash loop: model process {loops} restarted too often"
        return self.worker.alive(), self.worker.state.value

    def begin_drain(self) -> None:
        """Stop reporting ready and taking new work. The one writer of the drain state; safe to call
        from a signal handler (it only sets values)."""
        self._draining = True
        self.metrics.ready.set(0)

    async def drain(self, timeout: float) -> None:
        """Stop taking work; let admitted work finish (up to `timeout`)."""
        self.begin_drain()
        if not await self.batcher.drain(timeout):
            log.warning("drain timed out with %d pairs outstanding", self.batcher.outstanding)

    async def stop(self) -> None:
        await self.batcher.stop()
        await asyncio.to_thread(self.worker.stop)
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        """Everything /info shows: the model (once loaded), the runtime, the worker, the settings."""
        m = self.worker.info
        s, rt = self.settings, self.runtime
        return {
            "model_id": m.name if m else rt.model_dir.name,
            "model_path": str(rt.model_dir),
            "levels": m.labels if m else [],
            "max_length": m.max_length if m else s.max_length,
            "device": str(m.device) if m else rt.device,
            "dtype": m.dtype if m else rt.dtype,
            "version": package_version(),
            "state": self.readiness()[1],
            "model": m.details if m else {},
            "worker": self.worker.describe(),
            "settings": s.public(),
        }

    # --- scoring ------------------------------------------------------------------------------
    def _model(self) -> ModelInfo:
        info = self.worker.info
        if info is None:
            raise ServiceError(ErrorKind.NOT_READY, "not ready: loading", retry_after=1)
        return info

    def _check_ready(self) -> None:
        """Take work while a model serves, or while its processes restart (the work waits for them; its
        deadline and the queue's bounds still hold), so that a crash fails no request."""
        ok, why = self.readiness()
        if not ok and not (why == State.RESTARTING.value and self.worker.info is not None):
            raise ServiceError(ErrorKind.NOT_READY, f"not ready: {why}", retry_after=1)

    def refuse_early(self) -> ServiceError | None:
        """The 429 for a scoring request while admission is full, before its body is read or parsed: under
        overload, refusing costs microseconds and leaves the cores to the work admitted."""
        if not self.batcher.full():
            return None
        self.metrics.rejected.labels("overloaded").inc()
        retry = self.batcher.retry_after()
        return ServiceError(ErrorKind.OVERLOADED, f"queue full; retry in {retry:.0f}s", retry_after=retry)

    def _admit(self, pairs: int) -> None:
        try:
            self.batcher.check_admission(pairs)  # refuse before spending work
        except Overloaded as e:
            self.metrics.rejected.labels("overloaded").inc()
            raise ServiceError(ErrorKind.OVERLOADED, str(e), retry_after=e.retry_after) from None
        except Closed as e:
            raise ServiceError(ErrorKind.NOT_READY, str(e), retry_after=1) from None

    async def score(
        self,
        queries: list[str],
        titles: list[str],
        truncation: str = "only_second",
        side: str = "right",
        timeout_ms: int | None = None,
        allow_truncation: bool = True,
    ) -> Scored:
        self._check_ready()
        deadline = time.monotonic() + (timeout_ms or self.settings.request_timeout_ms) / 1000
        self._admit(len(queries))
        model = self._model()
        t0 = time.perf_counter()
        tok = model.tokenizer
        with self.tracing.span("qtrel.tokenize", pairs=len(queries)) as span:
            if len(queries) <= INLINE_PAIRS:  # ~50 us: cheaper here than a hop to the tokeniser thread
                enc = tok.encode(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
            else:
                enc = await asyncio.get_running_loop().run_in_executor(
                    self._tok_pool,
                    lambda: tok.encode(queries, titles, truncation=truncation, side=side),  # type: ignore[arg-type]
                )
            span.set_attribute("qtrel.tokens", sum(enc.lengths))
        self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
        if not allow_truncation and any(enc.truncated):
            i = enc.truncated.index(True)
            raise ServiceError(
                ErrorKind.TOO_LARGE,
                f"input {i} is longer than the model's {model.max_length} tokens; set truncate=true",
            )
        try:
            futures = self.batcher.submit(
                list(zip(enc.lengths, zip(enc.input_ids, enc.token_type_ids))),
                deadline,
                trace=self.tracing.context(),
                tag=f"request {request_id.get() or '-'}",
            )
        except Overloaded as e:
            self.metrics.rejected.labels("overloaded").inc()
            raise ServiceError(ErrorKind.OVERLOADED, str(e), retry_after=e.retry_after) from None
        except Closed as e:
            raise ServiceError(ErrorKind.NOT_READY, str(e), retry_after=1) from None
        try:
            outputs = await asyncio.gather(*futures)
        except DeadlineExceeded:
            self.metrics.rejected.labels("deadline").inc()
            raise ServiceError(ErrorKind.TIMEOUT, "the request's deadline passed before it was scored") from None
        except Closed as e:
            raise ServiceError(ErrorKind.NOT_READY, str(e), retry_after=1) from None
        except (asyncio.CancelledError, Exception) as e:
            for f in futures:  # the caller left, or the batch failed: drop what is still queued
                f.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise ServiceError(ErrorKind.BACKEND, f"inference failed: {_describe(e)}") from e
        self.metrics.pairs.inc(len(outputs))
        for o in outputs:
            self.metrics.levels.labels(model.labels[o.level]).inc()
        return Scored(list(outputs), enc, model.labels, model.name)

    async def tokenize(
        self, queries: list[str], titles: list[str], truncation: str = "only_second", side: str = "right"
    ) -> Tokenized:
        """The pairs' tokens under these truncation options, and their lengths before truncation."""
        model = self._model()
        tok = model.tokenizer

        def work() -> Tokenized:
            enc = tok.encode(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
            uniq = list(dict.fromkeys(queries))
            qtok = dict(zip(uniq, map(tok.tokens, tok.encode_texts(uniq))))
            return Tokenized(
                enc,
                [tok.tokens(ids) for ids in enc.input_ids],
                [qtok[q] for q in queries],
                [tok.tokens(ids) for ids in tok.encode_texts(titles)],
                model.max_length,
                model.name,
            )

        if len(queries) <= INLINE_PAIRS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, work)

    async def explain(self, query: str, title: str, **options) -> dict:
        """model.explain.explain_pair on a model, between batches (the worker's "explain" job)."""
        self._check_ready()
        try:
            return await self.worker.job("explain", query, title, **options)
        except Exception as e:
            ok, why = self.readiness()
            if not ok:  # the worker stopped or drains since the check above
                raise ServiceError(ErrorKind.NOT_READY, f"not ready: {why}", retry_after=1) from None
            raise ServiceError(ErrorKind.BACKEND, f"explanation failed: {_describe(e)}") from e


def _describe(e: Exception) -> str:
    """A backend error says what failed in its own words; anything else is named by its type."""
    return str(e) if isinstance(e, BackendError) else f"{type(e).__name__}: {e}"
