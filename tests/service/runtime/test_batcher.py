"""The batcher in isolation, with a fake `run` (it knows nothing of the model by design)."""

from __future__ import annotations

import asyncio
import time

import pytest

from service.runtime.batcher import Batcher, Closed, DeadlineExceeded, Item, Overloaded, padded_tokens, plan_batch


class Recorder:
    """A fake device: records each batch of payloads, optionally slow or failing."""

    def __init__(self, delay: float = 0.0, fail_on=None):
        self.batches: list[list] = []
        self.delay = delay
        self.fail_on = fail_on

    async def __call__(self, payloads):
        self.batches.append(list(payloads))
        await asyncio.sleep(self.delay)
        if self.fail_on is not None and self.fail_on in payloads:
            raise RuntimeError("device error")
        return [f"done:{p}" for p in payloads]


def make(run, **kw):
    args = dict(max_batch_tokens=64, max_batch_size=8, max_wait_s=0.01, max_queue_items=100, max_queue_tokens=10_000)
    args.update(kw)
    return Batcher(run, **args)


def test_plan_batch_sorts_by_length_and_keeps_the_oldest():
    loop = asyncio.new_event_loop()
    items = [Item(n, i, loop.create_future(), None) for i, n in enumerate([30, 5, 6, 31, 7, 29])]
    batch = plan_batch(items, max_tokens=64, max_size=8)
    assert items[0] in batch  # the oldest item always goes
    assert padded_tokens([it.length for it in batch]) <= 64
    assert sorted(it.length for it in batch) == [29, 30]  # its length neighbours, not the short ones
    short = plan_batch(items[1:], max_tokens=64, max_size=8)
    assert [it.length for it in short] == [5, 6, 7]
    loop.close()


def test_batches_respect_token_budget_and_size():
    async def main():
        rec = Recorder()
        b = make(rec, max_batch_tokens=40, max_batch_size=3)
        b.start()
        lengths = [10, 10, 10, 10, 20, 20, 5, 5, 5, 5, 5]
        futs = b.submit([(n, (i, n)) for i, n in enumerate(lengths)])
        res = await asyncio.gather(*futs)
        assert res == [f"done:{(i, n)}" for i, n in enumerate(lengths)]
        for batch in rec.batches:
            assert len(batch) <= 3
            assert max(n for _, n in batch) * len(batch) <= 40
        assert sum(len(x) for x in rec.batches) == len(lengths)
        await b.stop()

    asyncio.run(main())


def test_waits_briefly_to_merge_concurrent_submissions():
    async def main():
        rec = Recorder()
        b = make(rec, max_wait_s=0.05)
        b.start()
        futs = b.submit([(4, "a")])
        await asyncio.sleep(0.01)
        futs += b.submit([(4, "b")])
        await asyncio.gather(*futs)
        assert rec.batches == [["a", "b"]]
        await b.stop()

    asyncio.run(main())


def test_admission_is_bounded_by_items_and_tokens():
    async def main():
        b = make(Recorder(), max_batch_tokens=128, max_queue_items=4, max_queue_tokens=100)
        b.submit([(10, i) for i in range(3)])  # not started: they stay queued
        with pytest.raises(Overloaded) as e:
            b.submit([(10, "x"), (10, "y")])
        assert e.value.reason == "pairs" and e.value.retry_after >= 1
        with pytest.raises(Overloaded) as e:
            b.submit([(80, "z")])
        assert e.value.reason == "tokens"
        assert b.outstanding == 3
        with pytest.raises(ValueError):
            b.submit([(129, "too long for any batch")])
        await b.stop()

    asyncio.run(main())


def test_expired_and_cancelled_items_never_reach_run():
    async def main():
        rec = Recorder()
        b = make(rec, max_wait_s=0.05)
        late = b.submit([(4, "late")], deadline=time.monotonic() + 0.01)
        gone = b.submit([(4, "gone")])
        keep = b.submit([(4, "keep")])
        gone[0].cancel()
        await asyncio.sleep(0.03)
        b.start()
        assert await keep[0] == "done:keep"
        with pytest.raises(DeadlineExceeded):
            await late[0]
        assert rec.batches == [["keep"]]
        assert b.outstanding == 0
        await b.stop()

    asyncio.run(main())


def test_a_failing_batch_fails_only_its_items_and_the_loop_goes_on():
    async def main():
        rec = Recorder(fail_on="bad")
        b = make(rec, max_batch_size=1)
        b.start()
        futs = b.submit([(4, "ok1"), (4, "bad"), (4, "ok2")])
        res = await asyncio.gather(*futs, return_exceptions=True)
        assert res[0] == "done:ok1" and res[2] == "done:ok2"
        assert isinstance(res[1], RuntimeError)
        assert b.outstanding == 0
        await b.stop()

    asyncio.run(main())


def test_drain_finishes_admitted_work_and_refuses_new():
    async def main():
        rec = Recorder(delay=0.05)
        b = make(rec, max_batch_size=2)
        b.start()
        futs = b.submit([(4, i) for i in range(6)])
        drained = asyncio.create_task(b.drain(timeout=5))
        await asyncio.sleep(0)
        with pytest.raises(Closed):
            b.submit([(4, "new")])
        assert await drained is True
        assert [f.result() for f in futs] == [f"done:{i}" for i in range(6)]
        await b.stop()

    asyncio.run(main())


def test_oldest_item_is_not_starved_by_a_stream_of_short_ones():
    async def main():
        rec = Recorder(delay=0.005)
        b = make(rec, max_batch_tokens=64, max_batch_size=4, max_wait_s=0.0)
        b.start()
        long_one = b.submit([(60, "long")])
        for _ in range(20):
            b.submit([(4, "short")] * 4)
        await asyncio.wait_for(long_one[0], 1.0)
        first_batches = rec.batches[:2]
        assert any("long" in batch for batch in first_batches)
        await b.drain(5)
        await b.stop()

    asyncio.run(main())


def test_a_small_request_goes_before_a_big_one_that_came_a_moment_earlier():
    async def main():
        rec = Recorder()
        b = make(rec, max_batch_size=8)
        big = b.submit([(4, f"big{i}") for i in range(40)])
        await asyncio.sleep(0.005)
        small = b.submit([(4, "small")])
        b.start()
        await asyncio.gather(*big, *small)
        assert "small" in rec.batches[0]
        # ... but a big request is held back a bounded time only: it goes first once it waited long enough
        rec.batches.clear()
        big = b.submit([(4, f"big{i}") for i in range(40)])
        await asyncio.sleep(0.5)  # past SMALL_FIRST_MAX_S
        small = b.submit([(4, "small")])
        await asyncio.gather(*big, *small)
        assert "small" not in rec.batches[0]
        await b.stop()

    asyncio.run(main())


def test_an_item_whose_result_is_an_exception_fails_alone():
    async def run(payloads):
        return [ValueError(p) if p == "poison" else f"done:{p}" for p in payloads]

    async def main():
        b = make(run)
        b.start()
        res = await asyncio.gather(
            *b.submit([(4, "a"), (4, "poison"), (4, "b")], tag="request r1"), return_exceptions=True
        )
        assert res[0] == "done:a" and res[2] == "done:b" and isinstance(res[1], ValueError)
        assert b.outstanding == 0
        await b.stop()

    asyncio.run(main())
