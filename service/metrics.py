"""Prometheus metrics, all prefixed `qtrel_`, on a registry owned by one app (no global state)."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

if TYPE_CHECKING:
    from service.keys import KeyRing

# Millisecond-scale latencies: 1 ms .. 30 s.
LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.4, 0.6, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0)
BATCH_PAIRS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PRIORITIES = ("high", "low")  # the batcher's classes (service.runtime.batching.PRIORITIES), in its order
DIFF = (-4.0, -2.0, -1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)  # expected levels apart
RATIO = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)


class Metrics:
    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only add noise to every scrape
        r = self.registry = CollectorRegistry()
        self.requests = Counter("qtrel_requests", "HTTP requests", ["route", "status"], registry=r)
        self.request_seconds = Histogram(
            "qtrel_request_duration_seconds", "HTTP request duration", ["route"], buckets=LATENCY, registry=r
        )
        self.queue_seconds = Histogram(
            "qtrel_queue_seconds", "Time a pair waits in the queue", ["model"], buckets=LATENCY, registry=r
        )
        self.tokenize_seconds = Histogram(
            "qtrel_tokenize_seconds", "Tokenisation time per request", buckets=LATENCY, registry=r
        )
        self.inference_seconds = Histogram(
            "qtrel_inference_seconds", "Forward pass time per batch", ["model"], buckets=LATENCY, registry=r
        )
        self.batch_pairs = Histogram("qtrel_batch_pairs", "Pairs per batch", ["model"], buckets=BATCH_PAIRS, registry=r)
        self.batch_tokens = Histogram(
            "qtrel_batch_tokens",
            "Padded tokens per batch (longest x pairs)",
            ["model"],
            buckets=BATCH_TOKENS,
            registry=r,
        )
        self.padding_ratio = Histogram(
            "qtrel_batch_padding_ratio",
            "Share of a batch's tokens that are padding",
            ["model"],
            buckets=RATIO,
            registry=r,
        )
        self.queue_depth = Gauge("qtrel_queue_depth", "Pairs waiting in the queues, every model's together", registry=r)
        self.in_flight = Gauge(
            "qtrel_pairs_in_flight",
            "Pairs admitted and not finished, every model's together (the autoscaler's figure: the server's load)",
            registry=r,
        )
        self._queues: dict[int, tuple[int, int]] = {}  # per batcher (observer): its (queued, in flight)
        self.pairs = Counter("qtrel_pairs", "Pairs scored, by model", ["model"], registry=r)
        self.rejected = Counter("qtrel_rejected", "Requests refused or abandoned, by reason", ["reason"], registry=r)
        self.dropped_pairs = Counter(
            "qtrel_dropped_pairs",
            "Queued pairs dropped before the device, by model and reason",
            ["model", "reason"],
            registry=r,
        )
        self.levels = Counter("qtrel_predicted_level", "Predicted levels, by model", ["model", "level"], registry=r)
        self.worker_restarts = Counter(
            "qtrel_worker_restarts",
            "Model processes restarted, by reason: died (it exited), timeout (the watchdog killed it) or "
            "load_failed (a replacement could not load); a crash loop shows as a steady rate",
            ["model", "reason"],
            registry=r,
        )
        self.batches_retried = Counter(
            "qtrel_batches_retried",
            "Batches retried because their model process died or was killed",
            ["model"],
            registry=r,
        )
        self.batches_failed = Counter(
            "qtrel_batches_failed",
            "Batches whose requests failed, by reason: process_died (twice) or error (the model raised); "
            "after isolation, a batch of the one failing pair",
            ["model", "reason"],
            registry=r,
        )
        self.batches_split = Counter(
            "qtrel_batches_split",
            "Failed batches split in halves to isolate a failing (poison) pair, by reason: process_died or error",
            ["model", "reason"],
            registry=r,
        )
        self.requests_by_key = Counter(
            "qtrel_requests_by_key",
            "Requests that passed authentication, by API key id (the first 12 hex digits of the key's SHA-256, "
            "never the key); one series per key in force",
            ["key_id"],
            registry=r,
        )
        self._key_generation = -1  # the keyring's generation the key_id series were last set for
        self._key_ids: set[str] = set()
        self.cache_hits = Counter(
            "qtrel_cache_hits", "Distinct pairs of a request found in the score cache", registry=r
        )
        self.cache_misses = Counter(
            "qtrel_cache_misses", "Distinct pairs of a request looked up in the score cache and not found", registry=r
        )
        self.cache_evictions = Counter(
            "qtrel_cache_evictions", "Score cache entries evicted to stay under cache_mb", registry=r
        )
        self.cache_bytes = Gauge("qtrel_cache_bytes", "Bytes the score cache holds (its charge)", registry=r)
        self.cache_entries = Gauge("qtrel_cache_entries", "Pairs the score cache holds", registry=r)
        self.folded = Counter(
            "qtrel_duplicates_folded",
            "Pairs not forwarded because the same pair was computed once for them: a duplicate inside the "
            "request (where=request) or a pair already queued or in flight for another request (where=in_flight)",
            ["where"],
            registry=r,
        )
        for where in ("request", "in_flight"):
            self.folded.labels(where)
        self.ready = Gauge("qtrel_ready", "1 when the model is loaded, warmed up and not draining", registry=r)
        self.model_reloads = Counter(
            "qtrel_model_reloads",
            "Model reloads (SIGHUP or the admin route), by model and result: ok, or failed (the checkpoint "
            "did not load or warm up; the loaded model kept serving)",
            ["model", "result"],
            registry=r,
        )
        self.model_generation = Gauge(
            "qtrel_model_generation", "Load generation of each served model", ["model"], registry=r
        )
        self.shadow_pairs = Counter(
            "qtrel_shadow_pairs",
            "Live pairs scored again by the shadow model, by shadow model and the live model's level",
            ["model", "level"],
            registry=r,
        )
        self.shadow_agreed = Counter(
            "qtrel_shadow_agreed",
            "Shadowed pairs whose shadow level is the live level, by shadow model and live level",
            ["model", "level"],
            registry=r,
        )
        self.shadow_diff = Histogram(
            "qtrel_shadow_score_diff",
            "Shadow minus live expected level of a shadowed pair, by shadow model and live level",
            ["model", "level"],
            buckets=DIFF,
            registry=r,
        )
        self.shadow_abs_diff = Counter(  # a histogram with negative buckets has no _sum: the mean comes from here
            "qtrel_shadow_score_abs_diff",
            "Sum of |shadow - live| expected level over shadowed pairs (over qtrel_shadow_pairs: the mean)",
            ["model", "level"],
            registry=r,
        )
        self.shadow_dropped = Counter(
            "qtrel_shadow_dropped",
            "Sampled live pairs the shadow did not score, by reason: queue_full, busy (the live queue over half "
            "full), not_ready (the shadow still loads or failed) or failed",
            ["model", "reason"],
            registry=r,
        )
        self.model_info = Gauge(
            "qtrel_model_info", "Model being served", ["model", "device", "dtype", "version"], registry=r
        )
        self.admission_refused = Counter(
            "qtrel_admission_refused",
            "Scoring work refused at admission (429), by model and reason: pairs or tokens (a queue bound), or "
            "wait (the work queued ahead would take longer than max_queue_wait_ms at the model's measured rate)",
            ["model", "reason"],
            registry=r,
        )
        self.queue_depth_by_priority = Gauge(
            "qtrel_queue_depth_by_priority",
            "Pairs waiting in the queues by priority class (high: interactive; low: score jobs and requests "
            "that ask for it), every model's together",
            ["priority"],
            registry=r,
        )
        self._by_priority = [self.queue_depth_by_priority.labels(name) for name in PRIORITIES]
        self._depths: dict[int, Sequence[int]] = {}  # per batcher (observer): its pairs queued per class

        self.jobs = Gauge("qtrel_jobs", "Score jobs (/v1/jobs) on disk, by state", ["state"], registry=r)
        self.job_processes = Gauge(
            "qtrel_job_processes",
            "Score jobs' own model processes running (idle priority), by model",
            ["model"],
            registry=r,
        )
        self.job_pairs = Counter("qtrel_job_pairs", "Pairs scored by score jobs (rows written with scores)", registry=r)
        self.job_queue_pairs = Gauge(
            "qtrel_job_queue_pairs", "Pairs of queued and running score jobs not yet scored", registry=r
        )

    def queues_changed(self, batcher: int, items: int, in_flight: int) -> None:
        """One batcher's queue changed: the gauges are every batcher's together."""
        if items or in_flight:
            self._queues[batcher] = (items, in_flight)
        else:
            self._queues.pop(batcher, None)  # an idle or retired batcher leaves no entry behind
        self.queue_depth.set(sum(q for q, _ in self._queues.values()))
        self.in_flight.set(sum(f for _, f in self._queues.values()))

    def depths_changed(self, batcher: int, queued: Sequence[int]) -> None:
        """One batcher's queue per priority class changed: the gauge is every batcher's together."""
        if any(queued):
            self._depths[batcher] = queued
        else:
            self._depths.pop(batcher, None)
        for i, series in enumerate(self._by_priority):
            series.set(sum(q[i] for q in self._depths.values()))

    def for_model(self, model: str) -> ModelObserver:
        """The batcher's and the worker's observer for one served model: its series, labelled."""
        return ModelObserver(self, model)

    # called by service.http.deps.require_api_key
    def key_used(self, key_id: str, ring: KeyRing) -> None:
        """Count a request under its key's id; when the keys in force changed, their series are set anew
        (a key no longer in force loses its series), so the label's values are the keys in force."""
        if ring.generation != self._key_generation:
            self._key_generation = ring.generation
            ids = set(ring.ids)
            for old in self._key_ids - ids:
                self.requests_by_key.remove(old)
            for kid in ids - self._key_ids:
                self.requests_by_key.labels(kid)
            self._key_ids = ids
        if key_id in self._key_ids:  # else its key was rotated out since it was matched: no series for it
            self.requests_by_key.labels(key_id).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for every v of `values` (a labelled child): one locked add a bucket hit and one for the
    sum, counted in C, where observe takes a lock and walks the buckets in Python for each value (a batch's queue
    waits: once a pair, ~5% of the engine core's CPU at 30,000 requests/s; docs/fronts-bench.md)."""
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:  # a prometheus_client without these insides: one at a time
        for v in values:
            histogram.observe(v)
        return
    if not values:
        return
    for i, n in Tally(map(partial(bisect_left, bounds), values)).items():  # bisect_left: the first bound >= v
        buckets[i].inc(n)
    total.inc(sum(values))


class ModelObserver:
    """BatchObserver (the batcher) and WorkerObserver (the worker) for one model: Metrics' per-model
    series with its `model` label, every series of the model present from the start."""

    def __init__(self, metrics: Metrics, model: str):
        self.m, self.model = metrics, model
        for reason in ("died", "timeout", "load_failed"):
            metrics.worker_restarts.labels(model, reason)
        for reason in ("process_died", "error"):
            metrics.batches_failed.labels(model, reason)
            metrics.batches_split.labels(model, reason)
        for series in (metrics.batches_retried, metrics.pairs, metrics.inference_seconds, metrics.queue_seconds):
            series.labels(model)
        for series in (metrics.batch_pairs, metrics.batch_tokens, metrics.padding_ratio):
            series.labels(model)
        for reason in ("pairs", "tokens", "wait"):
            metrics.admission_refused.labels(model, reason)

    def queued(self, items: int, in_flight: int) -> None:
        self.m.queues_changed(id(self), items, in_flight)

    def dispatched(self, waits: Sequence[float], lengths: Sequence[int]) -> None:
        m, model = self.m, self.model
        observe_many(m.queue_seconds.labels(model), waits)
        padded = max(lengths) * len(lengths)
        m.batch_pairs.labels(model).observe(len(lengths))
        m.batch_tokens.labels(model).observe(padded)
        m.padding_ratio.labels(model).observe(1 - sum(lengths) / padded)

    def dropped(self, reason: str, n: int) -> None:
        self.m.dropped_pairs.labels(self.model, reason).inc(n)

    def refused(self, reason: str) -> None:
        self.m.admission_refused.labels(self.model, reason).inc()

    def depths(self, queued: Sequence[int]) -> None:
        self.m.depths_changed(id(self), queued)

    def forwarded(self, seconds: float) -> None:
        self.m.inference_seconds.labels(self.model).observe(seconds)

    def restarted(self, reason: str) -> None:
        self.m.worker_restarts.labels(self.model, reason).inc()

    def batch_retried(self) -> None:
        self.m.batches_retried.labels(self.model).inc()

    def batch_failed(self, reason: str) -> None:
        self.m.batches_failed.labels(self.model, reason).inc()

    def batch_split(self, reason: str) -> None:
        self.m.batches_split.labels(self.model, reason).inc()
