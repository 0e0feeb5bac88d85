"""A job's forward pass through the serving engine's live model processes (`job_processes=shared`, or where
the model's job driver could not load: service.runtime.background runs a job whole otherwise): model.bulk's
Scorer whose distinct pairs are tokenised and grouped into `qtrel score`'s very batches
(model.batches.bulk_batches: a float sum depends, by a last bit, on the batch it ran in, so these make its
bytes), each forwarded whole (`forward_batch`, service.runtime.whole). Live traffic goes first: the job paces
itself, sending a batch only while no interactive pair waits for a batch, to a model process that no live
batch and no other job batch holds; a live request that comes meanwhile waits at most for one batch, a live
one or the job's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from model.batches import bulk_batches
from model.bulk.score import score_rows
from model.levels import CHUNK_OVERLAP, MAX_BATCH_TOKENS, PairScore, ScoredBatch
from model.tokenizer import EncodedPairs
from service.jobs.api import Job
from service.runtime.engine import Closed, DeadlineExceeded, Engine, NotReady, Overloaded
from service.runtime.whole import backlog, forward_whole
from service.runtime.workers.worker import ModelInfo

log = logging.getLogger("qtrel.jobs")

PACE_S = 0.002  # how often a job looks again for room beside live traffic
RETRY_S = 0.5  # after the model was not ready (a reload, a restart)


async def forward_batch(engine: Engine, job: Job, batch: list[tuple[list[int], list[int]]]) -> list[PairScore]:
    """The one place job pairs reach a live model process: one batch, whole.
    (The batcher's low-priority class forms batches of its own, whose bits differ from `qtrel score`'s.)"""
    return await forward_whole(engine, batch, job.model)


class Stopped(Exception):
    """The server stops: the job stays unfinished on disk and resumes at the next start."""


class Cancelled(Exception):
    pass


class EngineScorer:
    """model.bulk's Scorer with the engine as its forward pass. Called on run_file's thread; the engine's
    calls run on the event loop `loop`. `halt()` says why to stop (a Stopped or Cancelled), checked before
    each slice."""

    def __init__(
        self,
        engine: Engine,
        job: Job,
        info: ModelInfo,
        loop: asyncio.AbstractEventLoop,
        halt: Callable[[], Exception | None],
    ):
        self.engine, self.job, self.info, self.loop, self.halt = engine, job, info, loop, halt
        self.labels = info.labels
        self.started, self.pairs = time.perf_counter(), 0  # this run's pairs scored, for the rate
        self.forwarded = 0  # distinct pairs (or windows) sent to the model, for run_file's summary
        self.in_flight = 0  # batches sent and not answered

    @property
    def rate(self) -> float:
        return self.pairs / max(time.perf_counter() - self.started, 1e-9)

    def __call__(self, pairs: Sequence[tuple[str, str] | None]) -> ScoredBatch[np.ndarray]:
        o = self.job.options
        overlap = CHUNK_OVERLAP if o.chunk_overlap is None else o.chunk_overlap
        return score_rows(self.labels, self.info.tokenizer, pairs, self._forward, o.max_chunks, overlap)

    def _forward(self, todo: list[tuple[str, str]]) -> ScoredBatch[np.ndarray]:
        """On run_file's thread: tokenise and plan as `qtrel score` does, then forward on the event loop."""
        queries, titles, how = [q for q, _ in todo], [t for _, t in todo], self.job.options.truncation
        enc = self.info.tokenizer.encode(queries, titles, truncation=how)
        batches = bulk_batches(enc.lengths, MAX_BATCH_TOKENS, self.info.device.startswith("cpu"))
        outputs = asyncio.run_coroutine_threadsafe(self.forward(enc, batches), self.loop).result()
        self.forwarded += len(todo)
        return ScoredBatch(  # PairScore's Python floats hold float32 values: back to float32 exactly
            np.array([x.logits for x in outputs], dtype=np.float32),
            np.array([x.probs for x in outputs], dtype=np.float32),
            np.array([x.expected for x in outputs], dtype=np.float32),
            np.array([x.level for x in outputs], dtype=np.int64),
        )

    async def forward(self, enc: EncodedPairs, batches: list[list[int]]) -> list[PairScore]:
        """The batches through the engine, paced; the pairs' outputs in their order."""
        out: list[PairScore | None] = [None] * len(enc.lengths)
        try:
            async with asyncio.TaskGroup() as tg:
                for batch in batches:
                    await self._room()
                    self.in_flight += 1
                    tg.create_task(self._send(batch, enc, out))
        except ExceptionGroup as group:  # a stop or a cancel first, else the first error
            errors: list[BaseException] = list(group.exceptions)
            raise next((e for e in errors if isinstance(e, Stopped | Cancelled)), errors[0]) from None
        return [x for x in out if x is not None]

    async def _room(self) -> None:
        """Wait for room: no live pair waiting for a batch, and a model process that neither a live batch nor one
        of the job's holds."""
        while True:
            if (why := self.halt()) is not None:
                raise why
            waiting, running, slots = backlog(self.engine, self.job.model)
            if not waiting and self.in_flight + running < slots:
                return
            await asyncio.sleep(PACE_S)

    async def _send(self, batch: list[int], enc: EncodedPairs, out: list[PairScore | None]) -> None:
        items = [(enc.input_ids[i], enc.token_type_ids[i]) for i in batch]
        try:
            while True:
                try:
                    got = await forward_batch(self.engine, self.job, items)
                    break
                except (Overloaded, DeadlineExceeded, Closed, NotReady):  # a reload or a restart: again
                    await asyncio.sleep(RETRY_S)
                    if (why := self.halt()) is not None:
                        raise why from None
        finally:
            self.in_flight -= 1
        for i, x in zip(batch, got, strict=True):
            out[i] = x
        self.pairs += len(batch)
        self.job.pairs_per_s = self.rate  # shown at once; saved with the next chunk
