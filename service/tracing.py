"""OpenTelemetry tracing: off by default, on with the standard `OTEL_*` environment.

On when `OTEL_TRACES_EXPORTER` names an exporter other than `none`, or an OTLP endpoint is set
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); `OTEL_SDK_DISABLED=true` wins. The
packages are the optional extra `pip install 'qtrel[otel]'`; without them the service runs untraced (one
warning if the environment asked for tracing). Everything else is the SDK's own environment: the OTLP
endpoint, headers and timeout, `OTEL_SERVICE_NAME` (default `qtrel`), `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER`, `OTEL_PROPAGATORS` (W3C `traceparent` by default: an incoming parent is respected).

Spans: one per request (FastAPI's instrumentation), and under it `qtrel.tokenize` (pairs, tokens),
`qtrel.queue_wait` (from submission until the batch holding the request's pairs went to a model process) and
`qtrel.forward` (that batch's trip to the model and back: batch size, tokens, padded tokens). The batcher
knows nothing of OpenTelemetry: it reports each batch's timings to a `BatchTracer` (`service.runtime.batcher`),
and this module turns them into spans with explicit start and end times under each request's context.

Nothing here imports OpenTelemetry (or FastAPI) at module level.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("qtrel.tracing")

QUIET_URLS = "health/live,health/ready,livez,readyz,metrics"  # probes and scrapes: no spans


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the standard environment asks for tracing."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()]
    if exporters:
        return exporters != ["none"]
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


class _NoSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        pass


class Tracing:
    """Tracing switched off: every call does nothing. The engine, the batcher and the app call only these."""

    enabled = False
    batch_tracer: Any = None  # a service.runtime.batcher.BatchTracer, or None: the batcher skips the call

    def context(self) -> Any:
        """The current trace context, handed with submitted work to the batcher (None when off)."""
        return None

    def carrier(self) -> dict | None:
        """The current trace context as W3C headers (`traceparent`): what a front sends the engine core
        with a request, so that the core's spans join the front's trace (None when off)."""
        return None

    def context_of(self, carrier: dict | None) -> Any:
        """The trace context a `carrier` describes (None when off or without one)."""
        return None

    @contextmanager
    def attached(self, context: Any) -> Iterator[None]:
        """Run the block under `context` (from `context_of`) as the current trace context."""
        yield

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        yield _NoSpan()

    def instrument(self, app: Any) -> None:
        pass

    def shutdown(self) -> None:
        pass


class OtelTracing(Tracing):
    """Tracing with an OpenTelemetry SDK `TracerProvider` (from the environment, or a test's)."""

    enabled = True

    def __init__(self, provider: Any):
        from opentelemetry import context as otel_context
        from opentelemetry import propagate, trace

        self.provider = provider
        self._tracer = provider.get_tracer("qtrel")
        self._context = otel_context
        self._trace = trace
        self._propagate = propagate  # OTEL_PROPAGATORS: W3C trace context and baggage by default
        self.batch_tracer = self

    def context(self) -> Any:
        return self._context.get_current()

    def carrier(self) -> dict | None:
        headers: dict = {}
        self._propagate.inject(headers)
        return headers or None

    def context_of(self, carrier: dict | None) -> Any:
        return self._propagate.extract(carrier) if carrier else None

    @contextmanager
    def attached(self, context: Any) -> Iterator[None]:
        if context is None:
            yield
            return
        token = self._context.attach(context)
        try:
            yield
        finally:
            self._context.detach(token)

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Any]:
        with self._tracer.start_as_current_span(name, attributes={f"qtrel.{k}": v for k, v in attributes.items()}) as s:
            yield s

    def batch(
        self,
        traces: Sequence[Any],
        enqueued: Sequence[float],
        started: float,
        ended: float,
        lengths: Sequence[int],
        error: BaseException | None,
    ) -> None:
        """service.runtime.batcher.BatchTracer: a batch's timings (monotonic seconds) -> a queue-wait and a forward
        span under each request that had pairs in it."""
        offset = time.time_ns() - time.monotonic_ns()
        ns = lambda t: int(t * 1e9) + offset
        groups: dict[int, tuple[Any, float, int]] = {}  # id(context) -> (context, first enqueued, pairs)
        for ctx, t in zip(traces, enqueued):
            if ctx is None:
                continue
            _, first, n = groups.get(id(ctx), (ctx, t, 0))
            groups[id(ctx)] = (ctx, min(first, t), n + 1)
        batch = {
            "qtrel.batch.size": len(lengths),
            "qtrel.batch.tokens": sum(lengths),
            "qtrel.batch.padded_tokens": max(lengths, default=0) * len(lengths),
        }
        for ctx, first, n in groups.values():
            wait = self._tracer.start_span(
                "qtrel.queue_wait", context=ctx, start_time=ns(first), attributes={"qtrel.pairs": n}
            )
            wait.end(end_time=ns(started))
            fwd = self._tracer.start_span(
                "qtrel.forward", context=ctx, start_time=ns(started), attributes={**batch, "qtrel.pairs": n}
            )
            if error is not None:
                fwd.record_exception(error)
                fwd.set_status(self._trace.Status(self._trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            fwd.end(end_time=ns(ended))

    def instrument(self, app: Any) -> None:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        excluded = None if os.environ.get("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS") else QUIET_URLS
        FastAPIInstrumentor.instrument_app(
            app, tracer_provider=self.provider, excluded_urls=excluded, exclude_spans=["receive", "send"]
        )

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the exporters still hold


def from_env(environ: Mapping[str, str] | None = None) -> Tracing:
    """The tracing the environment asks for: off (the default), or an SDK provider with the exporters
    `OTEL_TRACES_EXPORTER` names (`otlp`, the default, over HTTP/protobuf; `console`)."""
    environ = os.environ if environ is None else environ
    if not wanted(environ):
        return Tracing()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as e:
        log.warning(
            "OTEL_* asks for tracing but OpenTelemetry is not installed (pip install 'qtrel[otel]'): "
            "tracing is off (%s)",
            e,
        )
        return Tracing()
    named = environ.get("OTEL_SERVICE_NAME") or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": "qtrel"}))
    for name in [e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if e.strip()]:
        if name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as e:
                log.warning("the OTLP exporter is not installed (pip install 'qtrel[otel]'): %s", e)
                continue
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here (otlp, console, none): ignored", name)
    log.info("tracing on: exporters %s", environ.get("OTEL_TRACES_EXPORTER", "otlp"))
    return OtelTracing(provider)
