"""A front's engine (RemoteEngine) and the engine core (CoreServer) over a real Unix socket, on one event
loop, with the real engine on the tiny checkpoint: the per-frame path answers what the one-process engine
answers, a hung-up request lets go of its pairs, and the front's trace context and request id reach the
core's spans and queue."""

from __future__ import annotations

import asyncio
import sys

import pytest

from service.app import build_engine
from service.metrics import Metrics
from service.runtime import core as core_module
from service.runtime.batcher import Overloaded
from service.runtime.core import CoreServer
from service.runtime.remote import RemoteEngine
from service.settings import Settings
from service.tracing import OtelTracing, Tracing


def settings_for(model_dir, **overrides) -> Settings:
    return Settings(model=str(model_dir), device="cpu", dtype="float32", worker="thread", warmup=False, **overrides)


async def until(cond) -> bool:
    """True once `cond()` holds (within ~3 s of the loop's turns), else False."""
    for _ in range(300):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return False


def linked(
    tmp_path, model_dir, body, core_tracing: Tracing | None = None, front_tracing=None, with_core=False, **overrides
):
    """Run `body(engine, remote)` (with `with_core`: `body(engine, remote, core)`): the engine served by a
    CoreServer, the RemoteEngine connected to it."""
    s = settings_for(model_dir, **overrides)

    async def main():
        engine = build_engine(s, Metrics(), core_tracing)
        core = CoreServer(engine, str(tmp_path / "core.sock"))
        await core.start()
        assert await engine.start() is None
        core.push()
        remote = RemoteEngine(s, Metrics(), core.path, front_tracing)
        assert await remote.start() is None
        for _ in range(200):  # the first state push
            if remote.readiness()[0]:
                break
            await asyncio.sleep(0.01)
        try:
            return await (body(engine, remote, core) if with_core else body(engine, remote))
        finally:
            await remote.stop()
            await core.stop()
            await engine.drain(5)
            await engine.stop()

    return asyncio.run(main())


def test_the_frame_path_scores_as_the_engine_does_and_shares_the_cache(tmp_path, tiny_checkpoint):
    queries = ["cordless drill"] * 3
    titles = ["DEWALT 20V MAX Cordless Drill", "Garden hose 50 ft", "DEWALT 20V MAX Cordless Drill"]

    async def body(engine, remote):
        direct = await engine.score(queries, titles, use_cache=False)
        many = await asyncio.gather(*(remote.score(queries, titles) for _ in range(4)))  # one frame
        for got in many:
            for o, d in zip(got.outputs, direct.outputs, strict=True):
                assert o.logits == pytest.approx(d.logits, abs=1e-5) and o.level == d.level
            assert got.lengths == direct.lengths and got.labels == direct.labels
        hits = engine.metrics.registry.get_sample_value("qtrel_cache_hits_total") or 0
        again = await remote.score(queries[:1], titles[:1])
        assert (engine.metrics.registry.get_sample_value("qtrel_cache_hits_total") or 0) == hits + 1
        assert again.outputs[0].logits == pytest.approx(direct.outputs[0].logits, abs=1e-5)
        with pytest.raises(Exception, match="too long|truncat"):
            await remote.score(["drill " * 200], ["a title"], allow_truncation=False)
        return True

    assert linked(tmp_path, tiny_checkpoint, body)


def test_a_full_queue_is_a_429_and_a_hung_up_request_lets_go_of_its_pairs(tmp_path, tiny_checkpoint):
    async def body(engine, remote):
        titles = [f"title {i}" for i in range(6)]
        with pytest.raises(Overloaded):
            await remote.score(["q"] * 6, titles, use_cache=False)
        engine.batcher._slots._value = 0  # every model process busy: what is submitted stays queued
        task = asyncio.ensure_future(remote.score(["q"] * 3, titles[:3], use_cache=False))
        for _ in range(200):
            if engine.batcher.outstanding == 3:
                break
            await asyncio.sleep(0.01)
        assert engine.batcher.outstanding == 3 and len(engine.flights) == 3
        task.cancel()
        for _ in range(200):
            if all(f.future.cancelled() for f in engine.flights._in_flight.values()):
                break
            await asyncio.sleep(0.01)
        assert all(f.future.cancelled() for f in engine.flights._in_flight.values())
        assert engine.models.default.current.users == 0
        engine.batcher._slots._value = 1
        engine.batcher._wake.set()
        return True

    assert linked(tmp_path, tiny_checkpoint, body, max_queue_pairs=4, max_pairs_per_request=4, max_wait_ms=1)


def test_a_front_refuses_early_while_the_core_says_every_queue_is_full(tmp_path, tiny_checkpoint):
    """The core pushes its admission refusal on a change; the front refuses from it before any body is read,
    counts it as one process would, and lets requests through again once the queue has room."""

    async def body(engine, remote):
        assert remote.refuse_early() is None
        engine.batcher._slots._value = 0  # every model process busy: what is submitted stays queued
        held = asyncio.ensure_future(remote.score(["q"] * 4, [f"title {i}" for i in range(4)], use_cache=False))
        assert await until(lambda: remote.refuse_early() is not None)
        refusal = remote.refuse_early()
        assert isinstance(refusal, Overloaded) and refusal.reason == "pairs" and refusal.retry_after >= 1
        assert remote.metrics.registry.get_sample_value("qtrel_rejected_total", {"reason": "overloaded"}) == 2
        engine.batcher._slots.release()  # the model process free again: wakes the batcher waiting on it
        assert len((await held).outputs) == 4
        assert await until(lambda: remote.refuse_early() is None)  # room again: told within FULL_EVERY_S
        return True

    assert linked(tmp_path, tiny_checkpoint, body, max_queue_pairs=4, max_pairs_per_request=4, max_wait_ms=1)


def test_the_front_s_trace_and_request_id_reach_the_core(tmp_path, tiny_checkpoint):
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from service.logs import request_id

    exporter = InMemorySpanExporter()
    providers = [TracerProvider(), TracerProvider()]  # the front's and the core's: two processes in production
    for p in providers:
        p.add_span_processor(SimpleSpanProcessor(exporter))
    front, core = OtelTracing(providers[0]), OtelTracing(providers[1])
    tags: list[str] = []

    async def body(engine, remote):
        batcher = engine.batcher
        submit = batcher.submit

        def spy(*args, **kwargs):  # what the core queues the request's pairs under
            tags.append(kwargs.get("tag"))
            return submit(*args, **kwargs)

        batcher.submit = spy
        request_id.set("req-42")
        with front.span("front.request") as span:
            await remote.score(["cordless drill"], ["DEWALT 20V MAX Cordless Drill"], use_cache=False)
        return span.get_span_context()

    ctx = linked(tmp_path, tiny_checkpoint, body, core_tracing=core, front_tracing=front)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"front.request", "qtrel.queue_wait", "qtrel.forward"} <= set(spans), sorted(spans)
    for name in ("qtrel.queue_wait", "qtrel.forward"):  # recorded by the core, under the front's span
        assert spans[name].context.trace_id == ctx.trace_id
        assert spans[name].parent.span_id == ctx.span_id
    assert tags == ["request req-42"]


def test_tokens_of_a_reloaded_generation_are_stale_and_the_front_tokenises_again(tmp_path, tiny_checkpoint):
    async def body(engine, remote, core):
        first = await remote.score(["drill"], ["cordless drill"], use_cache=False)
        generation = engine.generation
        core._pusher.cancel()  # the front learns of the reload only when the test pushes the state
        await engine.reload()
        assert engine.generation == generation + 1
        task = asyncio.ensure_future(remote.score(["drill"], ["cordless drill"], use_cache=False))
        await asyncio.sleep(0.3)
        assert not task.done()  # Stale came back: the front waits for the new state
        core.push()
        again = await task  # tokenised again for the new generation
        assert remote.state["models"][0]["generation"] == generation + 1
        assert again.outputs[0].logits == pytest.approx(first.outputs[0].logits, abs=1e-5)
        return True

    assert linked(tmp_path, tiny_checkpoint, body, with_core=True)


def test_the_core_s_loop_is_uvloop_where_installed_and_asyncio_s_without(monkeypatch):
    from service.runtime.core import run_loop

    async def kind():
        return type(asyncio.get_running_loop()).__module__

    uvloop = pytest.importorskip("uvloop")
    assert run_loop(kind()).startswith(uvloop.__name__)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: import fails
    assert run_loop(kind()).startswith("asyncio")


def test_the_core_works_out_full_and_admit_again_only_when_a_queue_changed(tmp_path, tiny_checkpoint, monkeypatch):
    """Under overload the core's frames and queue changes ask for `full` and `admit`; while no queue's admission
    state changed, neither is worked out again (counted); a change (a hung-up request's pairs let go) reaches the
    fronts without waiting for a tick (there is none here after the first)."""
    monkeypatch.setattr(core_module, "FULL_EVERY_S", 60.0)
    monkeypatch.setattr(core_module, "STATE_EVERY_S", 60.0)

    async def body(engine, remote, core):
        b = engine.batcher
        calls = {"refusal": 0, "admission": 0}

        def counted(name):
            method = getattr(b, name)

            def call(*args, **kw):
                calls[name] += 1
                return method(*args, **kw)

            return call

        for name in calls:
            setattr(b, name, counted(name))
        b._slots._value = 0  # every model process busy: what is submitted stays queued
        held = asyncio.ensure_future(remote.score(["q"] * 4, [f"title {i}" for i in range(4)], use_cache=False))
        assert await until(lambda: core.full is not None and core.admit is not None)
        seen = dict(calls)
        for _ in range(20):
            core.push_full()
            core.push_admit(now=True)
            await asyncio.sleep(0.002)
        assert calls == seen  # nothing changed: nothing worked out again
        held.cancel()  # the core lets its pairs go: room again, pushed
        assert await until(lambda: core.full is None and core.admit is None and remote.refuse_early() is None)
        assert calls["refusal"] > seen["refusal"] and b.outstanding == 0
        b._slots._value = 1
        b._wake.set()
        return True

    assert linked(
        tmp_path, tiny_checkpoint, body, with_core=True, max_queue_pairs=4, max_pairs_per_request=4, max_wait_ms=1
    )
