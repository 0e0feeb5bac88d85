"""One /metrics for a server of several processes: each process's samples as plain values, and their
merge. Counters and histogram buckets, counts and sums add up across the processes; a gauge is set by one
process only (the engine core's queue, cache and model gauges; fronts set none), so its sum is its value.

A front that is replaced starts its counters again from zero. So that no merged counter goes backwards
(which Prometheus' rate() would read as a reset), `FrontSamples` keeps each front's last samples: a front
that does not answer a collection counts with them, and a front that is gone keeps counting with its last
counters and histograms (its gauges are dropped). What a killed front counted after its last collection
is lost: the merged counters stay monotonic, and undercount by that much."""

from __future__ import annotations

from collections.abc import Hashable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

# (family name, documentation, type, unit, [(sample name, labels, value)])
Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]
CUMULATIVE = ("counter", "histogram", "summary")  # what a gone front's samples still count in


def samples(registry: CollectorRegistry) -> list[Family]:
    return [
        (m.name, m.documentation, m.type, m.unit, [(s.name, s.labels, s.value) for s in m.samples])
        for m in registry.collect()
    ]


def add_up(parts: list[list[Family]]) -> list[Family]:
    """Every process's samples together, summed by series, in the first process's order."""
    order: list[str] = []
    heads: dict[str, tuple[str, str, str]] = {}
    values: dict[str, dict[tuple, float]] = {}
    labels_of: dict[tuple, dict[str, str]] = {}
    for part in parts:
        for name, doc, typ, unit, rows in part:
            if name not in heads:
                heads[name] = (doc, typ, unit)
                values[name] = {}
                order.append(name)
            into = values[name]
            for sname, labels, value in rows:
                key = (sname, tuple(sorted(labels.items())))
                labels_of[key] = labels
                into[key] = into.get(key, 0.0) + value
    return [
        (name, *heads[name], [(key[0], labels_of[key], value) for key, value in values[name].items()]) for name in order
    ]


class _Merged:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge(parts: list[list[Family]]) -> bytes:
    """The exposition text of every process's samples together, in the first process's order."""
    out = []
    for name, doc, typ, unit, rows in add_up(parts):
        m = Metric(name, doc, typ, unit)
        for sname, labels, value in rows:
            m.add_sample(sname, labels, value)
        out.append(m)
    return generate_latest(_Merged(out))  # generate_latest only calls collect()


class FrontSamples:
    """Each live front's last collected samples, and the counters and histograms of the fronts gone."""

    def __init__(self) -> None:
        self.last: dict[Hashable, list[Family]] = {}
        self.gone: list[Family] = []

    def seen(self, front: Hashable, part: list[Family]) -> None:
        self.last[front] = part

    def left(self, front: Hashable) -> None:
        """The front has ended: its cumulative samples count on, its gauges go."""
        part = self.last.pop(front, None)
        if part:
            kept = [f for f in part if f[2] in CUMULATIVE]
            self.gone = add_up([self.gone, kept])

    def parts(self) -> list[list[Family]]:
        """What the fronts add to /metrics: each live front's latest samples, and the gone fronts' sum."""
        return [*self.last.values(), self.gone]
