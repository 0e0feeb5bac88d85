"""Score jobs' way to the model processes, beside the engine's queue: a batch forwarded whole, as the job
formed it (`qtrel score`'s very batches, whose bits a job's output must match: the queue would form its own),
on the model's job processes where it has them (service.runtime.background: idle priority), else on a live
one; and the load a job paces itself by. The engine's readiness and reload rules hold (`require_ready`,
`hold`)."""

from __future__ import annotations

import time

from model.levels import PairScore
from service.runtime.background import Background
from service.runtime.batching import HIGH, LOW
from service.runtime.engine import Engine, InferenceFailed


def backlog(engine: Engine, model: str | None = None) -> tuple[int, int, int]:
    """A model's live traffic: its pairs waiting for a batch, its batches on the model processes; and the
    batches the model runs at once (its processes)."""
    batcher = engine.models.get(model).current.batcher
    return batcher.queued(HIGH) + batcher.queued(LOW), batcher.running, batcher.concurrency


def job_processes(engine: Engine, model: str | None = None) -> Background | None:
    """The model's job processes, if its jobs' batches go there now (None: to the live processes)."""
    return usable(engine.models.get(model).current.background)


def usable(bg: Background | None) -> Background | None:
    """`bg` if the job's batches may go there now (its processes started, or not yet tried)."""
    return bg if bg is not None and bg.usable else None


async def stop_job_processes(engine: Engine) -> None:
    """No job is left: every model's job processes end (the next job starts them again)."""
    for served in engine.models:
        if (bg := served.current.background) is not None:
            await bg.stop()


async def forward_whole(
    engine: Engine, batch: list[tuple[list[int], list[int]]], model: str | None = None
) -> list[PairScore]:
    """One batch of (input_ids, token_type_ids) forwarded whole on one of the model's job processes, or live
    processes; raises as `Engine.score` does (NotReady, InferenceFailed...)."""
    served = engine.require_ready(model)
    async with served.hold(time.monotonic() + engine.settings.request_timeout_ms / 1000) as slot:
        bg = usable(slot.background)
        out = await (bg.run(batch) if bg is not None else slot.worker.run(batch))
    errors = [o for o in out if isinstance(o, Exception)]
    if errors:
        raise InferenceFailed(f"inference failed: {errors[0]}") from errors[0]
    return [o for o in out if isinstance(o, PairScore)]
