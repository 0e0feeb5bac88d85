"""A candidate model scoring a sample of the default model's live pairs again, off the request path, so
that a team sees how it grades its own traffic before switching (`--shadow NAME=PATH --shadow-rate R`).

The engine hands over a request's pairs with the live answer after it is known (`offer`: a few list
appends, no await); a sample is kept in a bounded queue, and one task tokenises them on its own thread
and scores them in the shadow's own model process (niced, so the OS serves the live ones first), one
group at a time. It never delays or fails a live request: a full queue, a busy live model or a shadow
failure drops the pair, counted by reason. The comparison is counted per live level: pairs, level
agreement, and the distribution of shadow minus live expected level.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from model.levels import unpack_row
from service.metrics import Metrics
from service.runtime.slot import Served, Slot
from service.runtime.workers.backend import State

if TYPE_CHECKING:
    from service.runtime.results import Scored

log = logging.getLogger("qtrel.shadow")

GROUP = 32  # pairs tokenised and submitted together
BUSY = 0.5  # the live queue this full (share of max_queue_pairs): shadow pairs are dropped
DEADLINE_S = 30.0  # a shadow group not scored by then is given up (counted)
NICE = 19  # the shadow's model processes yield the cores to the live ones


class Shadow:
    def __init__(self, name: str, slot: Slot, rate: float, max_pending: int, live: Served, metrics: Metrics):
        self.name = name
        self.slot = slot
        self.rate = rate
        self.max_pending = max_pending
        self.live = live  # the default model: its load decides whether shadow work is taken
        self.metrics = metrics
        self._pending: deque[tuple[str, str, str, Any, list[str]]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._rng = random.Random()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="qtrel-shadow")
        self._niced: set[int] = set()
        for reason in ("queue_full", "busy", "not_ready", "failed"):
            metrics.shadow_dropped.labels(name, reason)

    def start(self) -> None:
        info = self.live.current.info  # started once the served models are up: their levels are known
        for level in info.labels if info else []:
            for series in (self.metrics.shadow_pairs, self.metrics.shadow_agreed, self.metrics.shadow_abs_diff):
                series.labels(self.name, level)
            self.metrics.shadow_diff.labels(self.name, level)
        self.slot.start()
        self._task = asyncio.create_task(self._loop(), name="qtrel-shadow")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.slot.batcher.stop()
        await asyncio.to_thread(self.slot.worker.stop)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def describe(self) -> dict:
        info = self.slot.info
        return {
            "id": self.name,
            "path": str(self.slot.runtime.model_dir),
            "state": self.slot.worker.state.value,
            "generation": self.slot.generation,
            "error": self.slot.worker.error,
            "rate": self.rate,
            "pending": len(self._pending),
            "max_pending": self.max_pending,
            "levels": info.labels if info else [],
        }

    # --- on the request path: cheap -----------------------------------------------------------
    def offer(self, queries: list[str], titles: list[str], scored: Scored, truncation: str, side: str) -> None:
        """A sample of a live request's pairs, with their live answer, for the shadow (or counted drops)."""
        picked = [i for i in range(len(titles)) if self._rng.random() < self.rate]
        if not picked:
            return
        why = self._refusal()
        if why is None and len(self._pending) + len(picked) > self.max_pending:
            why = "queue_full"
        if why is not None:
            self.metrics.shadow_dropped.labels(self.name, why).inc(len(picked))
            return
        labels = scored.labels
        for i in picked:
            self._pending.append((queries[i], titles[i], f"{truncation}/{side}", scored.outputs[i], labels))
        self._wake.set()

    def _refusal(self) -> str | None:
        if self.slot.worker.state != State.READY or self.slot.info is None:
            return "not_ready"
        live = self.live.current.batcher
        if live.outstanding > BUSY * live.max_queue_items:
            return "busy"  # under load the live model has the cores: dropped first
        return None

    # --- off the request path -----------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._nice()
            while self._pending:
                group = [self._pending.popleft() for _ in range(min(GROUP, len(self._pending)))]
                try:
                    await self._score(group)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the shadow's failure is its own: counted, never the live request's
                    log.warning("shadow %s: a group of %d pairs failed: %s", self.name, len(group), e)
                    self.metrics.shadow_dropped.labels(self.name, "failed").inc(len(group))

    async def _score(self, group: list[tuple[str, str, str, Any, list[str]]]) -> None:
        info = self.slot.info
        if info is None:
            self.metrics.shadow_dropped.labels(self.name, "not_ready").inc(len(group))
            return
        tok = info.tokenizer
        by_options: dict[str, list[int]] = {}
        for i, (_, _, options, _, _) in enumerate(group):
            by_options.setdefault(options, []).append(i)
        futures: dict[int, asyncio.Future] = {}
        loop = asyncio.get_running_loop()
        for options, idx in by_options.items():
            truncation, side = options.split("/")

            def encode(idx=idx, truncation=truncation, side=side):
                qs, ts = [group[i][0] for i in idx], [group[i][1] for i in idx]
                return tok.encode(qs, ts, truncation=truncation, side=side)

            enc = await loop.run_in_executor(self._pool, encode)
            items = list(zip(enc.lengths, zip(enc.input_ids, enc.token_type_ids)))
            futs = self.slot.batcher.submit(items, time.monotonic() + DEADLINE_S, tag=f"shadow {self.name}")
            futures.update(zip(idx, futs))
        done = await asyncio.gather(*futures.values(), return_exceptions=True)
        m = self.metrics
        for i, out in zip(futures, done):
            if isinstance(out, BaseException):
                m.shadow_dropped.labels(self.name, "failed").inc()
                continue
            live, live_labels, out = group[i][3], group[i][4], unpack_row(out)
            level = live_labels[live.level]
            m.shadow_pairs.labels(self.name, level).inc()
            if info.labels[out.level] == level:
                m.shadow_agreed.labels(self.name, level).inc()
            m.shadow_diff.labels(self.name, level).observe(out.expected - live.expected)
            m.shadow_abs_diff.labels(self.name, level).inc(abs(out.expected - live.expected))

    def _nice(self) -> None:
        """Lower the shadow's model processes' priority (once per process: a restarted one is niced anew)."""
        for pid in self.slot.worker.pids:
            if pid not in self._niced:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, pid, NICE)
                self._niced.add(pid)
