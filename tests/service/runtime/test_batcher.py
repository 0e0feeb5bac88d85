"""The batcher in isolation, with a fake `run` (it knows nothing of the model by design)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from service.runtime.batcher import Batcher, Closed, DeadlineExceeded, Item, Overloaded, padded_tokens, plan_batch
from service.runtime.batching import HIGH, LOW, form_batch
from service.runtime.pace import Pace


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


def test_a_big_request_is_not_starved_by_a_stream_of_small_ones():
    async def main():
        rec = Recorder(delay=0.002)
        b = make(rec, max_batch_tokens=64, max_batch_size=4, max_wait_s=0.0, max_queue_items=1000)
        b.start()
        big = b.submit([(4, f"big{i}") for i in range(20)])
        for _ in range(200):  # a one-pair request every millisecond, for longer than the big one's work
            b.submit([(4, "small")])
            await asyncio.sleep(0.001)
            if all(f.done() for f in big):
                break
        assert all(f.done() for f in big)  # it got its share of the batches meanwhile
        await b.drain(5)
        await b.stop()

    asyncio.run(main())


def test_a_small_request_goes_next_however_long_a_big_one_has_waited():
    async def main():
        rec = Recorder()
        b = make(rec, max_batch_size=8, max_queue_items=1000)
        big = b.submit([(4, f"big{i}") for i in range(40)])
        await asyncio.sleep(0.05)
        small = b.submit([(4, "small")])
        b.start()
        await asyncio.gather(*big, *small)
        assert "small" in rec.batches[0]
        # ... and behind a big one already being served: the next batch
        rec.batches.clear()
        rec.delay = 0.01
        big = b.submit([(4, f"big{i}") for i in range(40)])
        await asyncio.sleep(0.025)  # a few batches of it served
        n = len(rec.batches)  # the last of them is on the device
        small = b.submit([(4, "small")])
        await asyncio.gather(*big, *small)
        assert "small" in rec.batches[n], (n, rec.batches)
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


# --- priority classes, the measured pace, batches bounded in time, admission by expected wait -------------
def measured(rate: float, concurrency: int = 1) -> Pace:
    """A pace that has measured `rate` tokens a second (finished batches while work waited)."""
    pace = Pace(concurrency)
    for i in range(5):
        pace.done(int(rate), waiting=i < 4, now=float(i))  # the last ran the queue dry: what follows is new
    return pace


def test_pace_knows_nothing_until_measured_and_ignores_idle_time():
    pace = Pace(2)
    assert pace.rate == 0 and pace.seconds(1000) is None and pace.batch_tokens(0.05, 8192) == 8192
    pace.done(100, waiting=True, now=0.0)
    pace.done(100, waiting=True, now=0.1)
    assert pace.rate == 0  # one interval: not trusted yet
    for t in (0.2, 0.3):
        pace.done(100, waiting=True, now=t)
    assert pace.rate == pytest.approx(1000, rel=0.01)
    pace.done(100, waiting=False, now=0.4)  # nothing waited behind it: the queue ran dry
    pace.idle()
    pace.done(100, waiting=True, now=10.0)  # the 9.6 s gap was the traffic's, not the model's
    assert pace.rate == pytest.approx(1000, rel=0.01)
    assert pace.seconds(2000) == pytest.approx(2.0, rel=0.01)
    assert pace.batch_tokens(0.05, 256) == 25  # 1000 tokens/s over 2 processes, 50 ms of one's work
    assert pace.batch_tokens(0.05, 8192) == 768  # but never below 3/32 of the most: fixed costs would show
    assert pace.retry_after(3500, 1.0) == 3  # 3.5 s of work to bring down to 1 s


def test_a_high_priority_item_goes_first_and_low_work_fills_idle_time():
    async def main():
        rec = Recorder(delay=0.05)
        b = make(rec, max_batch_size=2, max_wait_s=0.0)
        low = b.submit([(4, f"low{i}") for i in range(6)], priority=LOW)
        b.start()
        await asyncio.sleep(0.02)  # the first low batch is on the device
        high = b.submit([(4, "high")])
        await asyncio.gather(*low, *high)
        assert all(p.startswith("low") for p in rec.batches[0])
        assert rec.batches[1] == ["high"]  # yielded within one batch, and rides alone: a batch holds one class
        assert sum(len(x) for x in rec.batches) == 7
        await b.stop()

    asyncio.run(main())


def test_queued_low_work_never_crowds_out_high_work():
    async def main():
        b = make(Recorder(), max_queue_items=10)
        b.submit([(4, i) for i in range(9)], priority=LOW)  # not started: queued
        fut = b.submit([(4, "x")], priority=LOW)
        with pytest.raises(Overloaded):
            b.submit([(4, "more low")], priority=LOW)
        assert len(b.submit([(4, h) for h in range(10)])) == 10  # high: queued low work is not counted
        with pytest.raises(Overloaded):
            b.submit([(4, "y")])
        assert b.queued(LOW) == 10 and b.queued(HIGH) == 10
        b.promote(fut)  # a high request joined that pair: it now waits for no low work
        assert b.queued(LOW) == 9 and b.queued(HIGH) == 11
        await b.stop()

    asyncio.run(main())


def test_refused_by_expected_wait_with_retry_after_from_the_measured_rate():
    async def main():
        b = make(Recorder(), max_batch_tokens=200, max_queue_tokens=100_000, pace=measured(1000), max_queue_wait_s=1.0)
        for i in range(11):  # one-pair requests of 100 tokens: the 11th has 1.0 s of work ahead, admitted
            b.submit([(100, i)])
        with pytest.raises(Overloaded) as e:  # 1.1 s ahead
            b.submit([(100, "late")])
        assert e.value.reason == "wait" and e.value.retry_after == 1 and "max_queue_wait_ms=1000" in str(e.value)
        assert b.full()
        b.max_queue_wait_s = 10.0
        for i in range(40):
            b.submit([(100, i)])
        b.max_queue_wait_s = 1.0
        with pytest.raises(Overloaded) as e:
            b.submit([(100, "later")], priority=LOW)
        assert e.value.retry_after == 5  # 5.1 s of work ahead, down to 1 s
        await b.stop()

    asyncio.run(main())


def test_a_one_pair_request_is_not_refused_for_the_big_one_it_will_pass():
    async def main():
        b = make(Recorder(), max_batch_tokens=200, max_queue_items=1000, pace=measured(1000), max_queue_wait_s=1.0)
        b.submit([(10, i) for i in range(150)])  # 1.5 s of work, ranked 0.3 s later than its arrival
        b.submit([(10, "one")])  # ranks before it: nothing ahead
        with pytest.raises(Overloaded):
            b.submit([(10, i) for i in range(150)])  # ranks after it
        await b.stop()

    asyncio.run(main())


def test_before_the_rate_is_measured_only_the_pair_bound_holds():
    async def main():
        b = make(Recorder(), max_batch_tokens=200, max_queue_items=50, pace=Pace(1), max_queue_wait_s=0.001)
        b.submit([(100, i) for i in range(50)])
        with pytest.raises(Overloaded) as e:
            b.submit([(100, "x")])
        assert e.value.reason == "pairs" and e.value.retry_after == 1
        await b.stop()

    asyncio.run(main())


def test_batches_hold_about_max_batch_s_of_work_and_the_pace_is_measured():
    async def main():
        async def run(payloads):  # a device that takes 1 ms per 10 tokens
            rec.batches.append(list(payloads))
            await asyncio.sleep(len(payloads) * 10 / 10_000)
            return payloads

        rec = Recorder()
        pace = measured(10_000)
        b = make(run, max_batch_tokens=1000, max_batch_size=100, max_queue_items=1000, pace=pace, max_batch_s=0.02)
        b.start()
        await asyncio.gather(*b.submit([(10, i) for i in range(200)]))
        assert max(len(x) for x in rec.batches) <= 20  # 20 ms of 10,000 tokens a second: 200 tokens
        assert 3_000 < pace.rate < 15_000  # measured from the batches themselves (sleep overshoots a little)
        unbounded = make(Recorder(), max_batch_tokens=1000, max_batch_size=100, max_queue_items=1000)
        unbounded.start()
        await asyncio.gather(*unbounded.submit([(10, i) for i in range(200)]))
        assert max(len(x) for x in unbounded._run.batches) == 100  # type: ignore[attr-defined]
        await b.stop()
        await unbounded.stop()

    asyncio.run(main())


def test_equal_requests_finish_in_arrival_order_not_all_at_the_end():
    async def main():
        rec = Recorder(delay=0.001)
        b = make(rec, max_batch_tokens=64, max_batch_size=8, max_queue_items=1000)
        a = b.submit([(n, f"a{i}") for i, n in enumerate([4, 4, 8, 8, 8, 8, 8, 8])])  # due at 56 tokens
        c = b.submit([(4, f"c{i}") for i in range(32)])  # due at 128: a length-sorted window would mix them
        b.start()
        await asyncio.gather(*a)
        assert not any(f.done() for f in c)  # the second request's items waited for the first's
        await asyncio.gather(*c)
        await b.stop()

    asyncio.run(main())


def test_the_time_bound_holds_while_a_big_request_is_queued_and_small_ones_alone_fill_a_batch():
    loop = asyncio.new_event_loop()

    def request(n: int, length: int, rank: float) -> list[Item]:  # one request's items, as Batcher.submit tags them
        return [Item(length, (rank, i), loop.create_future(), None, rank=rank, work=n * length) for i in range(n)]

    ones = [it for r in range(40) for it in request(1, 10, 10 + r * 30)]  # 40 one-pair requests, over 12 batches' time
    # split_tokens 50 (e.g. 50 ms at 1,000 tokens/s): small requests alone fill the batch to max_tokens, whole
    assert len(form_batch(ones, split_tokens=50, max_tokens=1000, max_size=100)) == 40
    assert len(form_batch(ones, split_tokens=50, max_tokens=200, max_size=100)) == 20  # max_tokens still binds
    big = request(200, 10, 2000.0)  # 2,000 tokens: 40 time-bounded batches' worth
    assert len(form_batch(big, split_tokens=50, max_tokens=1000, max_size=100)) == 5  # 50 tokens of it
    # while it is queued, every batch is time-bounded: a small request behind one waits one short batch at most
    assert len(form_batch(ones + big, split_tokens=50, max_tokens=1000, max_size=100)) == 2  # due within 50 tokens
    assert len(form_batch(request(200, 10, 5.0) + ones, split_tokens=50, max_tokens=1000, max_size=100)) == 5
    loop.close()


def test_the_admission_table_refuses_exactly_what_the_check_before_tokenisation_refuses():
    """What the engine core tells its fronts (Batcher.admission) is, for every request size, the refusal its own
    check before tokenisation (check_admission without tokens) answers: reason, Retry-After and message."""

    def key(r):
        return None if r is None else (r.reason, r.retry_after, str(r))

    async def main():
        b = make(Recorder(), max_batch_tokens=200, max_queue_items=400, pace=measured(1000), max_queue_wait_s=1.0)
        b.max_queue_tokens, b.max_queue_wait_s = 10**6, 100.0
        b.submit([(10, i) for i in range(60)])
        for i in range(20):
            b.submit([(5 + i, i)])
        for i in range(1, 15):  # requests of 20..280 tokens: the work ahead grows in steps with the request's size
            b.submit([(20, j) for j in range(i)])
        b.submit([(30, i) for i in range(40)])
        b.submit([(7, i) for i in range(25)], priority=LOW)
        b.max_queue_wait_s = 1.0
        most = 300
        end, table = b.admission(most, entries=1000)
        assert end == most and len(table) > 3 and {r.reason for _, r in table} == {"wait", "pairs"}
        firsts = [k for k, _ in table]
        for k in range(1, most + 1):
            got = next((r for first, r in reversed(table) if first <= k), None)
            assert key(got) == key(b.refusal(k)), k
            with pytest.raises(Overloaded) if got else contextlib.nullcontext():
                b.check_admission(k)
        assert firsts[0] > 1 and b.refusal(firsts[0] - 1) is None  # small requests are admitted
        end, few = b.admission(most, entries=2)  # bigger requests than two entries cover are left to the core
        assert [k for k, _ in few] == firsts[:2] and end == firsts[2] - 1
        # the wait ahead by bisection is the walk of the queue it replaced
        ahead = b._tokens[HIGH]
        for last in (0, 5, 12, 24.5, 600, 601, 1200, 5000):
            walked = sum(it.length for it in b._pending if it.priority == HIGH and it.rank > last)
            assert b._wait_ahead(HIGH, last) == ahead - walked
        await b.stop()

    asyncio.run(main())


def test_refusal_prunes_gone_work_once_and_only_when_some_is_gone():
    async def main():
        b = make(Recorder(), max_queue_items=10)
        futs = b.submit([(4, i) for i in range(10)])
        pending = b._pending
        assert b.refusal(1) is not None and b._pending is pending  # nothing gone: the queue is left as it is
        futs[0].cancel()
        assert b.refusal(1) is None and b.outstanding == 9  # the cancelled pair is ahead of no one
        await b.stop()

    asyncio.run(main())


def test_refusal_walks_the_queue_only_when_something_is_gone_or_due():
    async def main():
        b = make(Recorder(), max_queue_items=10)
        soon = time.monotonic() + 0.05
        futs = b.submit([(4, i) for i in range(5)], deadline=time.monotonic() + 60)
        futs += b.submit([(4, i) for i in range(5, 10)], deadline=soon)
        for _ in range(100):  # full, nothing gone, no deadline passed: no walk however often asked
            assert b.refusal(1) is not None
        assert b.walks == 0
        futs[3].cancel()  # a caller leaves: the next check walks once and drops its pair
        assert b.refusal(1) is None and b.outstanding == 9 and b.walks == 1
        assert b.refusal(1) is None and b.walks == 1
        b.submit([(4, "again")])
        assert b.refusal(1) is not None and b.walks == 1
        await asyncio.sleep(max(0.0, soon - time.monotonic()) + 0.01)  # the earliest deadline passes
        assert b.refusal(1) is None and b.outstanding == 5 and b.walks == 2
        assert all(isinstance(f.exception(), DeadlineExceeded) for f in futs[5:])
        assert b.refusal(1) is None and b.walks == 2  # the next deadline is a minute away: no walk
        await b.stop()

    asyncio.run(main())
