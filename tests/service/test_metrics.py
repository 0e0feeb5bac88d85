"""service.metrics: a batch's many observations added at once read exactly as one at a time."""

import math

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from service.metrics import observe_many


def _exposed(values: list[float], many: bool) -> bytes:
    r = CollectorRegistry()
    h = Histogram("qtrel_test_seconds", "test", ["model"], buckets=(0.001, 0.01, 0.1, 1.0), registry=r)
    child = h.labels("m")
    if many:
        observe_many(child, values)
    else:
        for v in values:
            child.observe(v)
    return b"\n".join(line for line in generate_latest(r).splitlines() if b"_created" not in line)


def test_observe_many_reads_as_observe_one_at_a_time():
    # on a bound, between bounds, below the first, above the last (+Inf), zero and repeated values
    values = [0.0, 0.001, 0.0010001, 0.005, 0.01, 0.01, 0.5, 1.0, 3.0, 1e9, 0.0999]
    assert _exposed(values, many=True) == _exposed(values, many=False)
    assert b'qtrel_test_seconds_bucket{le="0.01",model="m"} 6.0' in _exposed(values, many=True)


def test_observe_many_of_nothing_adds_nothing():
    assert _exposed([], many=True) == _exposed([], many=False)


def test_observe_many_falls_back_to_observe_without_the_insides():
    class Plain:
        seen: list[float] = []

        def observe(self, v: float) -> None:
            self.seen.append(v)

    p = Plain()
    observe_many(p, [1.0, math.pi])  # type: ignore[arg-type]
    assert p.seen == [1.0, math.pi]
