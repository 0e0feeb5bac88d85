"""One /metrics for a server of several processes: each process's samples as plain values, and their
merge. Counters and histogram buckets, counts and sums add up across the processes; a gauge is set by one
process only (the engine core's queue, cache and model gauges; fronts set none), so its sum is its value.

A front that is replaced starts its counters again from zero: the merged counters then drop by what the
old front had counted, which Prometheus' rate() reads as a counter reset."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

# (family name, documentation, type, unit, [(sample name, labels, value)])
Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]


def samples(registry: CollectorRegistry) -> list[Family]:
    return [
        (m.name, m.documentation, m.type, m.unit, [(s.name, s.labels, s.value) for s in m.samples])
        for m in registry.collect()
    ]


class _Merged:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge(parts: list[list[Family]]) -> bytes:
    """The exposition text of every process's samples together, in the first process's order."""
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
    out = []
    for name in order:
        doc, typ, unit = heads[name]
        m = Metric(name, doc, typ, unit)
        for key, value in values[name].items():
            m.add_sample(key[0], labels_of[key], value)
        out.append(m)
    return generate_latest(_Merged(out))  # generate_latest only calls collect()
