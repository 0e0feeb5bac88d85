"""The engine as a front process sees it: the same calls as the one-process `Engine`, so that the routes
never branch. It tokenises here (service.runtime.texts) and sends token ids to the engine core
(service.runtime.core); readiness and liveness come from the state the core pushes on every change.

A front holds no queue, cache or model: only a tokenizer per served model, loaded from the model's
directory for the generation the core serves. Tokens made for a generation the core has since reloaded
come back `Stale`; the front waits for the new state, loads the new tokenizer and sends them again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from model.tokenizer import PairTokenizer, pack_pair
from service.logs import request_id
from service.metrics import Metrics
from service.metrics_merge import samples
from service.runtime.batcher import Closed, DeadlineExceeded, Overloaded
from service.runtime.encoded import Stale
from service.runtime.models import ModelNotFound, ReloadBusy, ReloadFailed
from service.runtime.results import InferenceFailed, InputTooLong, Scored, Unreadable, check_readable, scored_of
from service.runtime.texts import TextSide
from service.runtime.wire import Channel, error_classes, load_error
from service.runtime.workers.backend import BackendError, NotReady
from service.runtime.workers.worker_api import ModelInfo
from service.settings import Settings
from service.tracing import Tracing

log = logging.getLogger("qtrel.front")

ERRORS = error_classes(
    BackendError,
    NotReady,
    Closed,
    DeadlineExceeded,
    Overloaded,
    Stale,
    ModelNotFound,
    ReloadBusy,
    ReloadFailed,
    InferenceFailed,
    InputTooLong,
    Unreadable,
    ValueError,
)
STALE_TRIES = 3  # a request tokenised again at most this often while models are reloaded under it
STATE_WAIT_S = 2.0


class RemoteEngine(TextSide):
    def __init__(self, settings: Settings, metrics: Metrics, path: str, tracing: Tracing | None = None):
        self.settings = settings
        self.metrics = metrics
        self.tracing = tracing or Tracing()
        self.path = path  # the core's Unix socket
        self.channel: Channel | None = None
        self.state: dict = {"ready": [False, "connecting to the engine core"], "live": [True, ""], "models": []}
        self._changed = asyncio.Event()
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = 0
        self._draining = False
        self._full: tuple | None = None  # the core's admission refusal (dump_error) while every queue is full
        self._admit: dict | None = None  # the core's refusals of big requests, per model (its "admit" frame)
        self._tokenizers: dict[tuple[str, int], PairTokenizer] = {}
        self._infos: dict[str, tuple[int, ModelInfo]] = {}  # name -> (generation, info with its tokenizer)
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="qtrel-tokenize")
        self.on_lost = lambda: None  # the core is gone: the front process ends (service.front)

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> str | None:
        loop = asyncio.get_running_loop()
        channel = self.channel = Channel(self._on_frame, self._lost)
        try:
            await loop.create_unix_connection(lambda: channel, self.path)
        except OSError as e:
            return f"cannot reach the engine core at {self.path}: {e}"
        channel.send(("hello", 0, os.getpid()))
        return None

    def _lost(self) -> None:
        self._full = self._admit = None
        self.state = {"ready": [False, "engine core gone"], "live": [False, "engine core gone"], "models": []}
        for f in self._waiting.values():
            if not f.done():
                f.set_exception(NotReady("engine core gone"))
        self.on_lost()

    def readiness(self) -> tuple[bool, str]:
        if self._draining:
            return False, "draining"
        ok, why = self.state["ready"]
        return ok, why

    def liveness(self) -> tuple[bool, str]:
        ok, why = self.state["live"]
        return ok, why

    def begin_drain(self) -> None:
        self._draining = True

    async def drain(self, timeout: float) -> None:
        self.begin_drain()  # the requests in flight are the HTTP server's to finish; the queue is the core's

    async def stop(self) -> None:
        if self.channel is not None:
            self.channel.on_close = lambda: None
            self.channel.close()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    def refuse_early(self) -> Overloaded | None:
        """While the core says every queue is full (its "full" frame), a scoring request is refused before
        its body is read or tokenised, as one process refuses it; counted here as the core counts its own."""
        if self._full is None:
            return None
        refusal = load_error(self._full, ERRORS)
        if not isinstance(refusal, Overloaded):
            return None
        models = self.state["models"]
        return self._counted(refusal, models[0]["name"] if models else "")

    def refusal(self, name: str, queries: list[str], titles: list[str], use_cache: bool) -> Overloaded | None:
        """What the core's admission would answer this high-priority request before tokenising it, by the
        table it pushed ("admit"): its distinct pairs, unless its cache might answer some. Counted as the core
        counts its own. A pair another request has queued already is the one the core would join and admit."""
        admit = self._admit
        if admit is None or (use_cache and admit["cache"]) or (got := admit["models"].get(name)) is None:
            return None
        end, table = got
        if len(queries) < table[0][0] or (k := len(set(zip(queries, titles)))) < table[0][0] or k > end:
            return None
        dumped = next(error for first, error in reversed(table) if first <= k)
        refusal = load_error(dumped, ERRORS)
        assert isinstance(refusal, Overloaded)
        return self._counted(refusal, name)

    def _counted(self, refusal: Overloaded, model: str) -> Overloaded:
        """A refusal made here on the core's word, counted as the core counts its own."""
        self.metrics.rejected.labels("overloaded").inc()
        self.metrics.admission_refused.labels(model, refusal.reason).inc()
        return refusal

    # --- frames ---------------------------------------------------------------------------------
    def _on_frame(self, frame: tuple) -> None:
        op, rid = frame[0], frame[1]
        if op == "done":
            waiting = self._waiting
            for rid, ok, value in frame[2]:
                f = waiting.pop(rid, None)
                if f is not None and not f.done():
                    if ok:
                        f.set_result(value)
                    else:
                        f.set_exception(load_error(value, ERRORS))
        elif op == "ok" or op == "err":
            f = self._waiting.pop(rid, None)
            if f is not None and not f.done():
                if op == "ok":
                    f.set_result(frame[2])
                else:
                    f.set_exception(load_error(frame[2], ERRORS))
        elif op == "state":
            self.state = frame[2]
            self._changed.set()
            self._changed = asyncio.Event()
            for m in self.state["models"]:  # load a new generation's tokenizer now, not in a request
                try:
                    self._tokenizer_of(m["name"], ready=False)
                except Exception as e:  # not loaded yet, or a tokenizer that fails: the requests will say
                    log.debug("tokenizer of %s not loaded: %s", m["name"], e)
        elif op == "full":
            self._full = frame[2]
        elif op == "admit":
            self._admit = frame[2]
        elif op == "collect":
            assert self.channel is not None
            self.channel.send(("collected", rid, samples(self.metrics.registry)))

    async def _ask(self, *frame: Any) -> Any:
        """Send a frame (its id filled in) and wait for its answer; ("scores", args) goes as one item of
        this turn's one score frame."""
        if self.channel is None or self.channel.closed.is_set():
            raise NotReady("engine core gone")
        self._ids += 1
        rid = self._ids
        f = asyncio.get_running_loop().create_future()
        self._waiting[rid] = f
        if frame[0] == "scores":
            self.channel.send_item("scores", (rid, frame[1]))
        else:
            self.channel.send((frame[0], rid, *frame[1:]))
        try:
            return await f
        except asyncio.CancelledError:
            self.channel.send(("cancel", rid))  # the client hung up: the core lets go of its pairs
            raise
        finally:
            self._waiting.pop(rid, None)

    # --- models ---------------------------------------------------------------------------------
    def _model_state(self, name: str | None) -> dict:
        models = self.state["models"]
        if not models:
            raise NotReady(self.state["ready"][1] or "loading")
        if name is None or len(models) == 1:
            return models[0]
        for m in models:
            if m["name"] == name:
                return m
        raise ModelNotFound(name, [m["name"] for m in models])

    def require_ready(self, model: str | None = None) -> None:
        ok, why = self.readiness()
        # as the engine's rule: a request held while draining is served, one meeting a restart waits for it
        if not ok and not why.startswith(("reloading", "draining", "restarting")):
            raise NotReady(why)
        self._model_state(model)

    def _tokenizer_of(self, model: str | None, ready: bool) -> tuple[str, ModelInfo]:
        if ready:
            self.require_ready(model)
        m = self._model_state(model)
        if m["info"] is None:
            raise NotReady("loading")
        held = self._infos.get(m["name"])
        if held is None or held[0] != m["generation"]:
            i = m["info"]
            key = (m["path"], i["max_length"])
            if (tok := self._tokenizers.get(key)) is None:
                tok = self._tokenizers[key] = PairTokenizer.from_dir(m["path"], max_length=i["max_length"])
            held = (m["generation"], ModelInfo(**i, tokenizer=tok, details={}))
            self._infos[m["name"]] = held
        return m["name"], held[1]

    # --- the engine's calls ---------------------------------------------------------------------
    async def score(
        self,
        queries: list[str],
        titles: list[str],
        truncation: str = "only_second",
        side: str = "right",
        timeout_ms: int | None = None,
        allow_truncation: bool = True,
        use_cache: bool = True,
        model: str | None = None,
        priority: str = "high",
        max_unknown: float | None = None,
    ) -> Scored:
        for _ in range(STALE_TRIES):
            name, info = self._tokenizer_of(model, ready=True)
            generation = self._infos[name][0]
            if priority == "high" and (refused := self.refusal(name, queries, titles, use_cache)) is not None:
                raise refused  # before tokenising it: the core would refuse it before looking at its tokens
            enc = await self._encode(info, queries, titles, truncation, side)
            check_readable(enc.unknown, max_unknown)  # counted here: the core gets the ids, and the shares to cache
            packed = [pack_pair(*p) for p in zip(enc.input_ids, enc.token_type_ids)]  # bytes: the core passes them on
            ids, segs = [p[0] for p in packed], [p[1] for p in packed]
            args = {
                "model": model,
                "generation": generation,
                "truncation": truncation,
                "side": side,
                "timeout_ms": timeout_ms,
                "allow_truncation": allow_truncation,
                "use_cache": use_cache,
                "priority": priority,
                "queries": queries,
                "titles": titles,
                "ids": ids,
                "segs": segs,
                "cut": enc.truncated,
                "unk": enc.unknown,
                "rid": request_id.get() or "",
                "tp": self.tracing.carrier(),  # the core's spans join this request's trace
            }
            try:
                rows = await self._ask("scores", args)
            except Stale:
                changed = self._changed
                if self._model_state(model)["generation"] == generation:  # the new state is on its way
                    await asyncio.wait_for(changed.wait(), STATE_WAIT_S)
                continue
            return scored_of(rows, enc.unknown)  # the rows unpacked here, not in the core: the fronts scale
        raise NotReady(f"model {model or 'default'} is being reloaded")

    async def explain(self, query: str, title: str, model: str | None = None, **options) -> dict:
        return await self._ask("call", "explain", {"query": query, "title": title, "model": model, **options})

    async def reload(self, name: str | None = None, path: str | None = None) -> dict | None:
        return await self._ask("call", "reload", {"name": name, "path": path})

    async def info(self) -> dict:
        return await self._ask("call", "info", {})

    async def model_list(self) -> list[dict]:
        return await self._ask("call", "model_list", {})

    async def jobs_wake(self, change: dict) -> Any:
        """Score jobs: this front changed the jobs directory; the core's job runner answers (service.jobs.desk)."""
        return await self._ask("call", "jobs_wake", change)

    async def render_metrics(self) -> bytes:
        return await self._ask("metrics")
