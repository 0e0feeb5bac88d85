"""The pair-score cache and single flight: a hit is what the forward returned, bit for bit; the byte bound
holds; the key holds everything that changes a result; each distinct pair is forwarded once, inside a
request and across concurrent ones. The engine runs the real tiny checkpoint on a thread."""

from __future__ import annotations

import asyncio
import random
import struct
import tracemalloc

import pytest

from model.levels import PairScore, pack_row
from service.runtime.cache import Cached, ScoreCache, make_key
from service.runtime.engine import DeadlineExceeded, Engine, InputTooLong
from service.runtime.flight import Flight, Flights
from tests.conftest import read_pairs
from tests.service.runtime.test_engine import make_engine, served


def key(i: int, **kw):
    args = {"model": "m", "generation": 1, "truncation": "only_second", "side": "right", "max_length": 128}
    return make_key(**(args | kw), query=f"query {i % 50}", title=f"title number {i} of a product")


def output(rng: random.Random) -> Cached:
    logits = [rng.uniform(-9, 9) for _ in range(5)]
    probs = [rng.random() for _ in range(5)]
    return Cached(
        pack_row(PairScore(logits, probs, rng.randrange(5), rng.uniform(1, 5))),
        rng.randint(3, 128),
        rng.random() < 0.5,
        rng.random(),
    )


def bits(c: Cached) -> bytes:
    return c.row + struct.pack("<dqq", c.unknown, c.length, c.truncated)


def test_a_stored_pair_comes_back_bit_for_bit():
    rng = random.Random(0)
    cache = ScoreCache(1 << 20)
    for i in range(200):
        want = output(rng)
        cache.put(key(i), want)
        got = cache.get(key(i))
        assert got is not None and bits(got) == bits(want) and got == want
        assert type(got.row) is bytes and type(got.length) is int and type(got.truncated) is bool
    assert cache.get(key(999)) is None


def test_the_byte_bound_holds_and_the_least_recent_go_first():
    rng = random.Random(1)
    cache = ScoreCache(50_000)
    cache.put(key(0), output(rng))
    evicted = 0
    for i in range(1, 1000):
        evicted += cache.put(key(i), output(rng))
        assert cache.bytes <= cache.max_bytes
        assert cache.get(key(0)) is not None  # used all along: never the least recent
    assert evicted == cache.evictions > 800 and len(cache) == 1000 - evicted
    assert cache.get(key(1)) is None and cache.get(key(999)) is not None
    cache.put(key(999), output(rng))  # a refreshed entry is charged once
    assert len(cache) == 1000 - evicted and cache.bytes <= cache.max_bytes


def test_an_entry_is_charged_what_it_costs():
    """The charge is the memory the entries take (texts, packed value, key tuple, the dict's share)."""
    rng = random.Random(2)
    pairs = read_pairs(2000)
    texts = [(q + f" {i}", t + f" {i}") for i in range(25) for q, t in pairs]  # 50k distinct Home Depot pairs
    values = [output(rng) for _ in range(len(texts))]
    cache = ScoreCache(1 << 30)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for (q, t), v in zip(texts, values):
            cache.put(make_key("m", 1, "only_second", "right", 128, q, t), v)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    texts_size = sum(q.__sizeof__() + t.__sizeof__() for q, t in texts)
    assert 0.85 < cache.bytes / (held + texts_size) < 1.2, (cache.bytes, held + texts_size)
    assert 400 < cache.bytes / len(cache) < 700  # per Home Depot pair: 64 MiB holds ~100k-160k


def test_off_at_zero():
    cache = ScoreCache(0)
    assert not cache.enabled and cache.put(key(0), output(random.Random(3))) == 0 and cache.get(key(0)) is None


def test_the_key_holds_what_changes_a_result():
    variants = [
        key(0),
        key(0, model="other"),
        key(0, generation=2),
        key(0, truncation="longest_first"),
        key(0, side="left"),
        key(0, max_length=64),
    ]
    assert len(set(variants)) == len(variants)


# --- through the engine -----------------------------------------------------------------------
def forwarded(e: Engine) -> float:
    """Pairs that reached the model: the batcher's qtrel_batch_pairs observations."""
    return e.metrics.registry.get_sample_value("qtrel_batch_pairs_sum", {"model": e.models.default.name}) or 0.0


def sample(e: Engine, name: str, **labels) -> float:
    return e.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_hit_is_what_the_forward_returned(tiny_checkpoint):
    pairs = read_pairs(12)
    qs, ts = [q for q, _ in pairs], [t for _, t in pairs]

    async def body(e: Engine):
        miss = await e.score(qs, ts)
        n = forwarded(e)
        hit = await e.score(qs, ts)
        assert forwarded(e) == n  # no forward
        assert sample(e, "qtrel_cache_hits_total") == len(set(pairs))
        fresh = await e.score(qs, ts, use_cache=False)  # Cache-Control: no-cache
        assert forwarded(e) == n + len(set(pairs))
        assert sample(e, "qtrel_cache_hits_total") == len(set(pairs))
        e.models.default.current.generation += 1  # as a reload does: nothing of the old generation is served
        again = await e.score(qs, ts)
        assert forwarded(e) == n + 2 * len(set(pairs))
        assert sample(e, "qtrel_cache_bytes") == e.cache.bytes > 0
        assert e.describe()["cache"]["generation"] == 2
        await e.reload(e.models.default.name)  # a real reload: a new copy, the cache let go
        assert e.generation == 3 and len(e.cache) == 0 == sample(e, "qtrel_cache_bytes")
        return miss, hit, fresh, again

    miss, hit, fresh, again = served(make_engine(tiny_checkpoint, cache_mb=1), body)
    for other in (hit, fresh, again):
        assert other.outputs == miss.outputs  # logits, probs, level, expected: float ==, bit for bit
        assert other.lengths == miss.lengths and other.truncated == miss.truncated


def test_a_cached_pair_too_long_is_still_refused_without_truncation(tiny_checkpoint):
    long = "a very long title " * 10

    async def body(e: Engine):
        await e.score(["q"], [long])  # cached, truncated
        with pytest.raises(InputTooLong) as err:
            await e.score(["q", "q"], ["short", long], allow_truncation=False)
        assert "input 1" in str(err.value)

    served(make_engine(tiny_checkpoint, max_length=16), body)


def test_duplicates_in_a_request_are_forwarded_once(tiny_checkpoint):
    async def body(e: Engine):
        out = await e.score(["q", "q", "r", "q", "r", "q"], ["a", "a", "b", "a", "b", "a"], use_cache=False)
        assert forwarded(e) == 2 and sample(e, "qtrel_duplicates_folded_total", where="request") == 4
        assert out.outputs[0] == out.outputs[1] == out.outputs[3] and out.outputs[2] == out.outputs[4]
        assert len(out.outputs) == 6

    served(make_engine(tiny_checkpoint, cache_mb=0), body)


def test_a_pair_in_flight_is_joined_not_forwarded_again(tiny_checkpoint):
    pairs = read_pairs(8)
    qs, ts = [q for q, _ in pairs], [t for _, t in pairs]

    async def body(e: Engine):
        # three requests at once (the batch waits 300 ms to fill), the same pairs in another order
        rs = await asyncio.gather(e.score(qs, ts), e.score(qs[::-1], ts[::-1]), e.score(qs[:3], ts[:3]))
        assert forwarded(e) == len(set(pairs))
        assert sample(e, "qtrel_duplicates_folded_total", where="in_flight") == len(set(pairs)) + 3
        assert rs[1].outputs[::-1] == rs[0].outputs and rs[2].outputs == rs[0].outputs[:3]
        assert len(e.flights) == 0

    served(make_engine(tiny_checkpoint, cache_mb=0, max_wait_ms=300), body)


def test_a_request_that_leaves_does_not_take_a_shared_pair_with_it(tiny_checkpoint):
    async def body(e: Engine):
        first = asyncio.ensure_future(e.score(["q", "q"], ["shared", "its own"]))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(e.score(["q"], ["shared"]))
        await asyncio.sleep(0.05)
        first.cancel()  # its client hung up: its own pair is dropped, the shared one still served
        out = await second
        assert len(out.outputs) == 1 and forwarded(e) == 1
        assert sample(e, "qtrel_dropped_pairs_total", model=e.models.default.name, reason="cancelled") == 1

    served(make_engine(tiny_checkpoint, cache_mb=0, max_wait_ms=300), body)


def test_another_requests_deadline_is_not_ours(tiny_checkpoint):
    async def body(e: Engine):
        hasty = asyncio.ensure_future(e.score(["q"], ["shared"], timeout_ms=50))
        await asyncio.sleep(0.01)
        patient = asyncio.ensure_future(e.score(["q"], ["shared"], timeout_ms=10_000))
        with pytest.raises(DeadlineExceeded):
            await hasty
        out = await patient  # queued again under its own deadline
        assert len(out.outputs) == 1 and forwarded(e) == 1

    served(make_engine(tiny_checkpoint, cache_mb=0, max_wait_ms=300), body)


def test_pairs_past_their_deadline_leave_the_flight_table(tiny_checkpoint):
    async def body(e: Engine):
        with pytest.raises(DeadlineExceeded):
            await e.score(["q"] * 3, ["a", "b", "c"], timeout_ms=20)
        await asyncio.sleep(0)
        assert len(e.flights) == 0 and forwarded(e) == 0
        out = await e.score(["q"], ["a"])  # asked again: queued afresh, not joined to the failed flight
        assert len(out.outputs) == 1 and forwarded(e) == 1

    served(make_engine(tiny_checkpoint, cache_mb=0, max_wait_ms=300), body)


def test_a_request_whose_flights_are_partly_done_waits_for_the_rest():
    """A request joining one pair that has landed and one still queued (the same titles sent at once): the
    queued one's exception was asked for before it had one (InvalidStateError: a 500 under SIGHUP)."""

    async def main() -> bool:
        loop = asyncio.get_running_loop()
        landed, queued = loop.create_future(), loop.create_future()
        landed.set_result(1)
        loop.call_later(0.01, queued.set_result, 2)
        flights = {k: Flight(f, None, 1, False, float("inf")) for k, f in (("a", landed), ("b", queued))}
        await Flights(lambda k, f: None).wait(flights, float("inf"), lambda k, f: f)
        return queued.done()

    assert asyncio.run(main())
