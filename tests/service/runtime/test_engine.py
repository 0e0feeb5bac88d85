"""The engine, handed its parts (runtime, worker, batcher, metrics) as the composition root does, on the
real tiny checkpoint with the model on a thread: readiness, drain, scoring, admission, explanations."""

from __future__ import annotations

import asyncio

import pytest

from model.relevance import RelevanceModel
from service.app import build_engine
from service.http.schemas import Info
from service.metrics import Metrics
from service.runtime.engine import INLINE_PAIRS, Engine, InputTooLong, NotReady, Overloaded
from service.runtime.workers.backend import State
from service.settings import Settings
from tests.conftest import read_pairs


def make_engine(model_dir, **overrides) -> Engine:
    s = Settings(model=str(model_dir), device="cpu", dtype="float32", worker="thread", warmup=False, **overrides)
    return build_engine(s, Metrics())  # wired as the composition root wires it


def served(engine: Engine, body):
    """Run `body(engine)` between the engine's start and stop, on one event loop."""

    async def main():
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.drain(5)
            await engine.stop()

    return asyncio.run(main())


def gauge(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_readiness_follows_the_model_and_the_drain(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint)
    assert engine.readiness() == (False, "loading")
    Info(**engine.describe())  # /info answers before the model is loaded
    assert engine.describe()["model_id"] == tiny_checkpoint.name and engine.describe()["levels"] == []

    async def body(e: Engine):
        assert e.readiness() == (True, "ready") and e.liveness()[0]
        assert gauge(e.metrics, "qtrel_ready") == 1
        info = Info(**e.describe())
        assert info.levels == ["1", "2", "3", "4", "5"] and info.worker["mode"] == "thread"
        assert info.state == "ready" and info.settings["worker"] == "thread"
        scored = await e.score(["drill"], ["cordless drill"])
        assert scored.labels == ["1", "2", "3", "4", "5"] and scored.model == tiny_checkpoint.name
        e.begin_drain()
        assert e.readiness() == (False, "draining") and gauge(e.metrics, "qtrel_ready") == 0
        assert (await e.score(["drill"], ["a drill held by the HTTP server"])).labels  # still taken
        await e.drain(5)  # the HTTP server is done: no new work from here
        with pytest.raises(NotReady) as err:
            await e.score(["drill"], ["cordless drill"])
        assert err.value.why == "draining"

    served(engine, body)
    assert engine.worker.state == State.STOPPED


def test_scores_match_the_model_alone_inline_and_on_the_tokeniser_thread(tiny_checkpoint):
    pairs = read_pairs(INLINE_PAIRS + 5)
    ref = RelevanceModel.load(tiny_checkpoint)
    want = [ref.predict([p])[0] for p in pairs]

    async def body(e: Engine):
        few = await e.score([q for q, _ in pairs[:2]], [t for _, t in pairs[:2]])  # tokenised inline
        many = await e.score([q for q, _ in pairs], [t for _, t in pairs])  # on the tokeniser thread
        return few, many

    few, many = served(make_engine(tiny_checkpoint), body)
    for scored, n in ((few, 2), (many, len(pairs))):
        assert len(scored.outputs) == n
        for out, ref_score, tokens, pair in zip(scored.outputs, want, scored.lengths, pairs):
            assert out.probs == pytest.approx(ref_score.probs, abs=1e-5)
            assert out.expected == pytest.approx(ref_score.expected, abs=1e-5)
            assert out.level == ref_score.level and tokens == ref.encode([pair]).lengths[0]


def test_admission_and_truncation_are_refused_with_their_kinds(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint, max_queue_pairs=4, max_pairs_per_request=4, max_length=16)

    async def body(e: Engine):
        with pytest.raises(Overloaded) as err:
            await e.score(["q"] * 5, [f"t{i}" for i in range(5)])  # 5 distinct pairs: more than the queue holds
        assert err.value.retry_after >= 1
        assert len((await e.score(["q"] * 5, ["t"] * 5)).outputs) == 5  # one distinct pair: one forward
        with pytest.raises(InputTooLong, match="set truncate=true"):
            await e.score(["q"], ["a very long title " * 10], allow_truncation=False)
        assert len((await e.score(["q"], ["a very long title " * 10])).outputs) == 1  # truncated

    served(engine, body)
    assert engine.metrics.registry.get_sample_value("qtrel_rejected_total", {"reason": "overloaded"}) == 1


def test_explanations_are_the_workers_named_job(tiny_checkpoint):
    async def body(e: Engine):
        return await e.explain("cordless drill", "DEWALT cordless drill", top_heads=2, attention=False)

    out = served(make_engine(tiny_checkpoint), body)
    assert {"tokens", "layers", "term_matching_heads", "occlusion"} <= set(out)
    heads = out["term_matching_heads"]  # the pair shares "cordless" and "drill": top_heads of them, best first
    assert len(heads) == 2 and heads[0]["score"] >= heads[1]["score"]


def test_a_model_that_cannot_load_fails_readiness_and_scoring(tmp_path):
    async def body(e: Engine):
        ok, why = e.readiness()
        assert not ok and why.startswith("model failed to load") and "config.json" in why
        with pytest.raises(NotReady, match="model failed to load"):
            await e.score(["q"], ["t"])
        for _ in range(100):  # the replica thread ends: liveness follows
            if not e.liveness()[0]:
                break
            await asyncio.sleep(0.02)
        assert e.liveness() == (False, "failed")

    served(make_engine(tmp_path), body)
