"""The engine core's request server: the one place where the front processes reach the engine.

With `--http-workers N` above 1, `qtrel serve` is the engine core: it alone owns the batcher queues (one
per model: batches form across every front), the pair-score cache and single flight, admission, the
model processes, the shadow, reloads and drain. The fronts (service.front) do HTTP, validation, keys,
tokenisation and response shaping, and send the core token ids over a Unix socket (service.runtime.wire):

    front -> core   ("score", id, args)     token ids and the texts (the cache key), once
                    ("call", id, name, args) explain, reload, info, model_list: rare, by name
                    ("metrics", id)          /metrics: the core asks every front for its samples
                    ("cancel", id)           the client hung up: the core drops the request's pairs
    core -> front   ("ok", id, value) or ("err", id, error)
                    ("state", 0, snapshot)   readiness, liveness and each model's generation and path,
                                             pushed on every change (probes never wait on the core)
                    ("collect", id)          the front's metric samples, for a merged /metrics

It knows nothing of HTTP: errors cross as the runtime's own classes (wire.dump_error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from model.tokenizer import EncodedPairs
from service.logs import request_id
from service.metrics_merge import merge, samples
from service.runtime.encoded import Encoded
from service.runtime.engine import Engine
from service.runtime.wire import Channel, dump_error

log = logging.getLogger("qtrel.core")

STATE_EVERY_S = 0.1  # how often the core looks for a change of state to push to the fronts
COLLECT_TIMEOUT_S = 2.0  # a front that does not answer a metrics collection in time is left out
CALLS = ("explain", "reload", "info", "model_list")  # what a front may call by name


def scored_value(s) -> tuple:
    """A `Scored` as plain values (service.runtime.remote rebuilds it)."""
    return ([(o.logits, o.probs, o.level, o.expected) for o in s.outputs], s.lengths, s.truncated, s.labels, s.model)


class Link:
    """One front's connection: its requests in progress, by id."""

    def __init__(self, core: CoreServer):
        self.core = core
        self.channel = Channel(self.on_frame, self.on_close)
        self.tasks: dict[int, asyncio.Task] = {}
        self.collecting: dict[int, asyncio.Future] = {}
        self.pid = 0

    def on_frame(self, frame: tuple) -> None:
        op, rid = frame[0], frame[1]
        if op == "score":
            self._start(rid, self.core.score(frame[2]))
        elif op == "cancel":
            if (t := self.tasks.get(rid)) is not None:
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
        for f in self.collecting.values():
            if not f.done():
                f.cancel()
        self.core.links.discard(self)

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
        self.links: set[Link] = set()
        self._server: asyncio.AbstractServer | None = None
        self._pusher: asyncio.Task | None = None
        self._last: dict | None = None
        self._ids = 0
        # SIGTERM: the fronts' probes say not ready while the requests they hold still reach the engine
        self.draining = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._link, self.path)
        self._pusher = asyncio.create_task(self._push_changes(), name="qtrel-core-state")

    def _link(self) -> Channel:
        link = Link(self)
        self.links.add(link)
        return link.channel

    async def stop(self) -> None:
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

    async def _push_changes(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self.push()
            await asyncio.sleep(STATE_EVERY_S)

    # --- requests -------------------------------------------------------------------------------
    async def score(self, a: dict) -> tuple:
        token = request_id.set(a.pop("rid"))
        try:
            enc = Encoded(EncodedPairs(a.pop("ids"), a.pop("segs"), a.pop("cut"), a.pop("unk")), a.pop("generation"))
            return scored_value(await self.engine.score(a.pop("queries"), a.pop("titles"), encoded=enc, **a))
        finally:
            request_id.reset(token)

    async def call(self, name: str, args: dict) -> Any:
        if name not in CALLS:
            raise ValueError(f"no such call: {name}")
        if name == "info":
            return await self.engine.info() | {"fronts": self.describe_fronts()}
        value = await getattr(self.engine, name)(**args)
        if name == "reload":
            self.push()  # the fronts learn the new generation before the caller hears of it
        return value

    async def metrics_text(self) -> bytes:
        """/metrics for the whole server: the core's samples and every front's, merged (counters and
        histograms summed; each gauge is set by one process only, so its sum is its value)."""
        parts = [samples(self.engine.metrics.registry)]
        self._ids += 1
        found = await asyncio.gather(*(link.collect(self._ids) for link in list(self.links)), return_exceptions=True)
        parts += [p for p in found if isinstance(p, list)]
        return merge(parts)
