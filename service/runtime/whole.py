"""Score jobs' way to the model: the model's job driver where it has one (service.runtime.background: the
whole job in a process at idle priority), else a batch forwarded whole on a live model process, beside the
engine's queue, as the job formed it (`qtrel score`'s very batches, whose bits a job's output must match: the
queue would form its own); and the load such a job paces itself by. The engine's readiness and reload rules
hold (`require_ready`, `hold`)."""

from __future__ import annotations

import time

from model.levels import PairScore, unpack_row
from service.runtime.background import Background
from service.runtime.batching import HIGH, LOW
from service.runtime.engine import Engine, InferenceFailed


def backlog(engine: Engine, model: str | None = None) -> tuple[int, int, int]:
    """A model's live traffic: its pairs waiting for a batch, its batches on the model processes; and the
    batches the model runs at once (its processes)."""
    batcher = engine.models.get(model).current.batcher
    return batcher.queued(HIGH) + batcher.queued(LOW), batcher.running, batcher.concurrency


def job_processes(engine: Engine, model: str | None = None) -> Background | None:
    """The model's job driver, if its jobs run there now (its driver loaded its model before, or has not
    tried yet; None: on the live processes)."""
    bg = engine.models.get(model).current.background
    return bg if bg is not None and bg.usable else None


async def stop_job_processes(engine: Engine) -> None:
    """No job is left: every model's job driver is gone (and the next job tries one again after a failed load)."""
    for served in engine.models:
        if (bg := served.current.background) is not None:
            await bg.stop()


async def forward_whole(
    engine: Engine, batch: list[tuple[list[int], list[int]]], model: str | None = None
) -> list[PairScore]:
    """One batch of (input_ids, token_type_ids) forwarded whole on one of the model's live processes; raises as
    `Engine.score` does (NotReady, InferenceFailed...)."""
    served = engine.require_ready(model)
    async with served.hold(time.monotonic() + engine.settings.request_timeout_ms / 1000) as slot:
        out = await slot.worker.run(batch)
    errors = [o for o in out if isinstance(o, Exception)]
    if errors:
        raise InferenceFailed(f"inference failed: {errors[0]}") from errors[0]
    return [unpack_row(o) for o in out if isinstance(o, bytes)]
