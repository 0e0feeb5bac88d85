"""The engine core's request server: the one place where the front processes reach the engine.

With `--http-workers N` above 1, `qtrel serve` is the engine core: it alone owns the batcher queues (one
per model: batches form across every front), the pair-score cache and single flight, admission, the
model processes, the shadow, reloads and drain. The fronts (service.front) do HTTP, validation, keys,
tokenisation and response shaping, and send the core token ids over a Unix socket (service.runtime.wire):

    front -> core   ("scores", 0, [(id, args), ...])  the score requests of one event-loop turn: token ids,
                                             the texts (the cache key), the request id and the trace
                                             context (W3C traceparent), each request's fields once
                    ("call", id, name, args) explain, reload, info, model_list, jobs_wake: rare, by name
                    ("metrics", id)          /metrics: the core asks every front for its samples
                    ("cancel", id)           the client hung up: the core drops the request's pairs
    core -> front   ("done", 0, [(id, ok, rows or error), ...])  the score answers of one turn: each
                                             request's rows as the model processes packed them, joined
                                             (service.runtime.results.Rows), which the front unpacks
                    ("ok", id, value) or ("err", id, error)  a call's answer (and a score held by a reload)
                    ("state", 0, snapshot)   readiness, liveness and each model's generation and path,
                                             pushed on every change (probes never wait on the core)
                    ("full", 0, error or None)  admission: every queue full (the Overloaded a request
                                             would meet, as wire.dump_error), or room again; pushed on a
                                             change, so that a front refuses before reading a body
                    ("admit", 0, {"cache": on, "models": {name: (end, [(k, error), ...])}} or None)  per model,
                                             the refusal of k high pairs before tokenisation from each k up
                                             to `end` (Batcher.admission), where some k would be refused:
                                             a front refuses such a request before tokenising it (worked out
                                             when a queue changed, at most every ADMIT_EVERY_S otherwise;
                                             sent on a change)
                    ("collect", id)          the front's metric samples, for a merged /metrics

A frame's requests are taken on the event loop without a task each (service.runtime.scoring: one
callback per pair; replies of a turn in one frame); only a model held by an in-place reload sends its
requests down the engine's awaited path. It knows nothing of HTTP: errors cross as the runtime's own
classes (wire.dump_error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, TypeVar

from model.tokenizer import EncodedPairs
from service.logs import request_id
from service.metrics_merge import FrontSamples, merge, samples
from service.runtime.encoded import Encoded
from service.runtime.engine import Engine
from service.runtime.results import Rows, rows_of
from service.runtime.scoring import SLOW, Pending, Turn
from service.runtime.wire import Channel, dump_error

log = logging.getLogger("qtrel.core")

STATE_EVERY_S = 0.1  # how often the core looks for a change of state to push to the fronts
# While the fronts refuse (every queue full), how often the core looks whether there is room again: a queue
# is refused only with ~a second of work ahead (max_queue_wait_ms), so this lag leaves the model no gap.
FULL_EVERY_S = 0.01
ADMIT_EVERY_S = 0.01  # how often at most a tick or a frame that queued nothing works out the admission table
ADMIT_ENTRIES = 16  # refusals in a model's table at most (requests bigger than it covers go to the core)
COLLECT_TIMEOUT_S = 2.0  # a front that does not answer a metrics collection in time is left out
T = TypeVar("T")
CALLS = ("explain", "reload", "info", "model_list", "jobs_wake")  # what a front may call by name


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run the core's event loop to `main`'s end: uvloop where it is installed, as uvicorn picks it for a front
    and for one process, else asyncio's. asyncio's own selector, handles and socket transports are Python, and
    the core does little but run them (docs/fronts-bench.md)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


class Link:
    """One front's connection: its requests in progress, by id."""

    def __init__(self, core: CoreServer):
        self.core = core
        self.channel = Channel(self.on_frame, self.on_close)
        self.tasks: dict[int, asyncio.Task] = {}
        self.pending: dict[int, Pending] = {}  # score requests taken without a task, by id
        self.collecting: dict[int, asyncio.Future] = {}
        self.pid = 0

    def on_frame(self, frame: tuple) -> None:
        op, rid = frame[0], frame[1]
        if op == "scores":
            self._scores(frame[2])
        elif op == "cancel":
            if (p := self.pending.pop(rid, None)) is not None:
                p.cancel()
                self.core.queue_changed()  # its queued pairs are gone: room, maybe
            elif (t := self.tasks.get(rid)) is not None:
                t.cancel()
        elif op == "call":
            self._start(rid, self.core.call(frame[2], frame[3]))
        elif op == "metrics":
            self._start(rid, self.core.metrics_text())
        elif op == "collected":
            if (f := self.collecting.pop(rid, None)) is not None and not f.done():
                f.set_result(frame[2])
        elif op == "hello":
            self.pid = frame[2]
            self.channel.send(("state", 0, self.core.snapshot()))
            if self.core.full is not None:
                self.channel.send(("full", 0, self.core.full))
            if self.core.admit is not None:
                self.channel.send(("admit", 0, self.core.admit))

    def _scores(self, requests: list) -> None:
        engine, tracing = self.core.engine, self.core.engine.tracing
        turn = Turn()
        for rid, a in requests:
            try:
                p = engine.take(a, tracing.context_of(a["tp"]), partial(self._reply, rid), turn)
            except Exception as e:  # a malformed request: its answer, not the frame's end
                self._reply(rid, e, None)
                continue
            if p is SLOW:
                self._start(rid, self.core.score(a))
            elif p is not None:
                self.pending[rid] = p  # type: ignore[assignment]
        for batcher in turn.touched:
            batcher.report()
        self.core.push_full()
        self.core.push_admit(now=bool(turn.touched))  # work was queued: the fronts hear it before the next frame

    def _reply(self, rid: int, error: BaseException | None, rows: Rows | None) -> None:
        self.pending.pop(rid, None)
        if self.core.full is not None:  # a batch has left the queue: room, maybe, told with this answer
            self.core.push_full_soon()
        if error is None:
            self.channel.send_item("done", (rid, True, rows))
        else:
            self.channel.send_item("done", (rid, False, dump_error(error)))

    def _start(self, rid: int, job) -> None:
        task = asyncio.ensure_future(self._answer(rid, job))
        self.tasks[rid] = task
        task.add_done_callback(lambda t: self.tasks.pop(rid, None))

    async def _answer(self, rid: int, job) -> None:
        try:
            value = await job
        except asyncio.CancelledError:
            return  # the front cancelled it: its client is gone, nobody reads an answer
        except Exception as e:
            self.channel.send(("err", rid, dump_error(e)))
            return
        self.channel.send(("ok", rid, value))

    def on_close(self) -> None:
        for t in list(self.tasks.values()):
            t.cancel()  # the front is gone: so are its clients
        for p in list(self.pending.values()):
            p.cancel()
        self.pending.clear()
        for f in self.collecting.values():
            if not f.done():
                f.cancel()
        self.core.links.discard(self)
        self.core.front_samples.left(self)  # its counters stay in /metrics: they never go backwards

    async def collect(self, cid: int) -> list:
        f = asyncio.get_running_loop().create_future()
        self.collecting[cid] = f
        self.channel.send(("collect", cid))
        try:
            return await asyncio.wait_for(f, COLLECT_TIMEOUT_S)
        finally:
            self.collecting.pop(cid, None)


class CoreServer:
    """Serves the engine to the front processes on a Unix socket at `path`."""

    def __init__(self, engine: Engine, path: str, health: Callable[[], tuple[bool, str]] = lambda: (True, "")):
        self.engine = engine
        self.path = path
        self.health = health  # the fronts' own liveness (their supervisor's crash-loop rule)
        self.describe_fronts: Callable[[], dict] = dict
        self.jobs_wake: Callable[[dict], Awaitable[Any]] | None = None  # the job runner's (service.jobs.runner)
        self.links: set[Link] = set()
        self._server: asyncio.AbstractServer | None = None
        self._pusher: asyncio.Task | None = None
        self._last: dict | None = None
        self.full: tuple | None = None  # the admission refusal last pushed (dump_error), None: room
        self._full_soon = False
        self.admit: dict | None = None  # the admission table last pushed (push_admit)
        self._admit_at = self._state_at = 0.0
        # what the queues' admission read when `full` and `admit` were last worked out (admission_state)
        self._full_state: tuple | None = None
        self._admit_state: tuple | None = None
        self._ids = 0
        self.front_samples = FrontSamples()
        # SIGTERM: the fronts' probes say not ready while the requests they hold still reach the engine
        self.draining = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._link, self.path)
        self.engine.models.on_queue_change = self.queue_changed
        self._pusher = asyncio.create_task(self._push_changes(), name="qtrel-core-state")

    def _link(self) -> Channel:
        link = Link(self)
        self.links.add(link)
        return link.channel

    async def stop(self) -> None:
        self.engine.models.on_queue_change = lambda: None
        if self._pusher is not None:
            self._pusher.cancel()
        if self._server is not None:
            self._server.close()
        for link in list(self.links):
            link.channel.close()

    # --- state ----------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What a front answers probes and routes requests from: readiness, liveness, each model."""
        e = self.engine
        live = e.liveness()
        if live[0]:
            live = self.health()
        models = []
        for m in e.models:
            info = m.current.info
            models.append(
                {
                    "name": m.name,
                    "generation": m.generation,
                    "path": str(m.current.runtime.model_dir),
                    "info": None
                    if info is None
                    else {k: getattr(info, k) for k in ("name", "labels", "max_length", "device", "dtype")},
                }
            )
        ready = [False, "draining"] if self.draining else list(e.readiness())
        return {"ready": ready, "live": list(live), "models": models}

    def push(self) -> None:
        """Send the state to every front if it changed since the last push."""
        snap = self.snapshot()
        if snap != self._last:
            self._last = snap
            for link in list(self.links):
                link.channel.send(("state", 0, snap))

    def admission_state(self) -> tuple:
        """Every served queue's admission state (Batcher.admission_state): while it is the same, so are the
        refusals that `full` and `admit` say, and they are not worked out again (ticks under overload)."""
        return tuple((m.current.batcher, m.current.batcher.admission_state()) for m in self.engine.models)

    def push_full(self) -> None:
        """Tell every front when admission fills up or has room again (a changed Retry-After too)."""
        if (state := self.admission_state()) == self._full_state:
            return
        self._full_state = state
        refusal = self.engine.refusal()
        if refusal is None:
            if self.full is None:
                return
            full = None
        else:
            if self.full is not None and self.full[2] == refusal.__dict__:
                return
            full = dump_error(refusal)
        self.full = full
        for link in list(self.links):
            link.channel.send(("full", 0, full))

    def push_full_soon(self) -> None:
        """push_full at the end of this turn of the event loop, once however often asked."""
        if not self._full_soon:
            self._full_soon = True
            asyncio.get_running_loop().call_soon(self._push_full_now)

    def _push_full_now(self) -> None:
        self._full_soon = False
        self.push_full()

    def admission(self) -> dict | None:
        """What the "admit" frame says: per model whose queue would refuse some request of up to
        max_pairs_per_request high pairs, the refusals before tokenisation (Batcher.admission); None if none."""
        e = self.engine
        most, models = e.settings.max_pairs_per_request, {}
        for m in e.models:
            end, table = m.current.batcher.admission(most, ADMIT_ENTRIES)
            if table:
                models[m.name] = (end, [(k, dump_error(r)) for k, r in table])
        return {"cache": e.cache.enabled, "models": models} if models else None

    def push_admit(self, now: bool = False) -> None:
        """Tell every front the admission table when it changed, working it out at most every ADMIT_EVERY_S
        unless `now` (work was just queued)."""
        t = time.monotonic()
        if not now and t - self._admit_at < ADMIT_EVERY_S:
            return
        self._admit_at = t
        if (state := (self.engine.cache.enabled, self.admission_state())) == self._admit_state:
            return
        self._admit_state = state
        if (admit := self.admission()) != self.admit:
            self.admit = admit
            for link in list(self.links):
                link.channel.send(("admit", 0, admit))

    def queue_changed(self) -> None:
        """A queue changed (work queued, a batch formed or finished, work dropped): tell the fronts what admission
        says now, if that changed too. Called in the turn of the event loop that changed it, so that under overload
        the fronts hear of room without the core waking every FULL_EVERY_S for it (each wake costs ~0.1 ms of CPU
        on a shared 2-vCPU host)."""
        try:
            self.push_full()
            self.push_admit(now=True)
        except Exception:
            log.exception("pushing admission to the fronts failed")

    async def _push_changes(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self.push_full()
                self.push_admit()
                if (t := time.monotonic()) - self._state_at >= STATE_EVERY_S * 0.9:  # (a timer may fire a bit early)
                    self._state_at = t
                    self.push()
            # while every queue is full, look again often; else each queue's change tells the fronts (queue_changed)
            await asyncio.sleep(FULL_EVERY_S if self.full is not None else STATE_EVERY_S)

    # --- requests -------------------------------------------------------------------------------
    async def score(self, a: dict) -> tuple:
        """One score request on the engine's awaited path (a model held by an in-place reload)."""
        token = request_id.set(a.pop("rid"))
        tracing = self.engine.tracing
        try:
            with tracing.attached(tracing.context_of(a.pop("tp"))):
                enc = Encoded(
                    EncodedPairs(a.pop("ids"), a.pop("segs"), a.pop("cut"), a.pop("unk")), a.pop("generation")
                )
                return rows_of(await self.engine.score(a.pop("queries"), a.pop("titles"), encoded=enc, **a))
        finally:
            request_id.reset(token)

    async def call(self, name: str, args: dict) -> Any:
        if name not in CALLS:
            raise ValueError(f"no such call: {name}")
        if name == "info":
            return await self.engine.info() | {"fronts": self.describe_fronts()}
        if name == "jobs_wake":  # a front changed the jobs directory
            if self.jobs_wake is None:
                raise ValueError("score jobs are off")
            return await self.jobs_wake(args)
        value = await getattr(self.engine, name)(**args)
        if name == "reload":
            self.push()  # the fronts learn the new generation before the caller hears of it
        return value

    async def metrics_text(self) -> bytes:
        """/metrics for the whole server: the core's samples and every front's, merged (counters and
        histograms summed; each gauge is set by one process only, so its sum is its value)."""
        await self.collect_fronts()
        return merge([samples(self.engine.metrics.registry), *self.front_samples.parts()])

    async def collect_fronts(self) -> None:
        """Every front's samples, kept (service.metrics_merge.FrontSamples); also every second, so that a
        front killed loses at most its last second of counts."""
        self._ids += 1
        links = list(self.links)
        found = await asyncio.gather(*(link.collect(self._ids) for link in links), return_exceptions=True)
        for link, part in zip(links, found, strict=True):
            if isinstance(part, list) and link in self.links:  # else its last samples count (FrontSamples)
                self.front_samples.seen(link, part)
