"""Composition root: settings -> runtime -> metrics -> worker -> batcher -> engine -> routes.

The runtime (model directory, device, precision, process layout) is resolved once here, in the
lifespan, and each part is handed what it needs; HTTP reaches the parts only through `service.http.deps`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI

from service.http import errors, openapi
from service.http.admin import admin_router
from service.http.admin import router as models_router
from service.http.cohere import router as compat_router
from service.http.deps import admin_off, require_admin_key, require_api_key
from service.http.edge import EdgeMiddleware
from service.http.explain import explain_routers
from service.http.fast import FastLane, routes_of
from service.http.jobs import router as jobs_router
from service.http.routes import metrics_router, ops_router, router
from service.http.tokenize import router as tokenize_router
from service.jobs.desk import JobDesk
from service.jobs.runner import JobRunner
from service.metrics import Metrics
from service.runtime.engine import Engine, EngineAPI
from service.runtime.layout import package_version
from service.runtime.models import Models
from service.settings import Settings
from service.tracing import Tracing
from service.tracing import from_env as tracing_from_env

log = logging.getLogger("qtrel.http")

# Routers whose every route needs `Authorization: Bearer <key>` when API keys are set (require_api_key):
# scoring, /info and, added in create_app, /explain. A new router of scoring or model routes goes here.
PROTECTED_ROUTERS: list[APIRouter] = [router, compat_router, tokenize_router, models_router, jobs_router]
UPLOAD_SLACK = 1 << 20  # an upload's body beyond the file: the multipart framing and the option fields


class Lifecycle:
    """What the process needs to reach from outside the app: drain on SIGTERM; end the process when the
    model cannot be loaded at start (`on_fatal`, set by whoever runs the server)."""

    def __init__(self) -> None:
        self.engine: EngineAPI | None = None  # set by the lifespan
        self.fatal: str | None = None  # why the server cannot serve, once known
        self.on_fatal: Callable[[str], None] | None = None
        self.reloaders: list[Callable[[], None]] = []  # what SIGHUP re-reads

    def hangup(self) -> None:
        """SIGHUP: re-read what can change without a restart. It never ends the server or drops work."""
        log.info("SIGHUP: reloading %d part(s)", len(self.reloaders))
        for reload in self.reloaders:
            try:
                reload()
            except Exception as e:  # the last good state keeps serving
                log.error("reload on SIGHUP failed: %s", e)

    def begin_drain(self) -> None:
        if self.engine is not None:
            self.engine.begin_drain()

    async def start(self, engine: EngineAPI) -> None:
        why = await engine.start()
        if why is not None:
            self.fatal = why
            log.critical(why)
            if self.on_fatal is not None:
                self.on_fatal(why)


def build_engine(settings: Settings, metrics: Metrics, tracing: Tracing | None = None) -> Engine:
    """Resolve each model's runtime once (its share of the cores) and wire the parts: per model its worker
    (the model processes) and batcher (the queue), the shadow, the engine (service.runtime.models)."""
    return Engine(settings, Models(settings, metrics, tracing), metrics, tracing=tracing)


def on_loop(loop: asyncio.AbstractEventLoop, job: Callable[[], Awaitable[object]]) -> Callable[[], None]:
    """A callable for a signal handler that starts `job` on the event loop (a handler must not await)."""
    running: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references to tasks

    def start() -> None:
        task = asyncio.ensure_future(job())
        running.add(task)
        task.add_done_callback(running.discard)

    def handler() -> None:
        loop.call_soon_threadsafe(start)

    return handler


def create_app(
    settings: Settings | None = None,
    lifecycle: Lifecycle | None = None,
    tracing: Tracing | None = None,
    engine_factory: Callable[[Settings, Metrics, Tracing], EngineAPI] = build_engine,
) -> FastAPI:
    """The app; `engine_factory` makes its engine in the lifespan: the one-process engine, or in a front
    process the engine core's proxy (service.front), whose calls are the same."""
    settings = settings or Settings()
    tracing = tracing or tracing_from_env()  # off unless the OTEL_* environment asks (service.tracing)
    lifecycle = lifecycle or Lifecycle()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = engine_factory(settings, metrics, tracing)
        lifecycle.engine = engine
        # Load and warm up in the background: the server answers /health/* (503) meanwhile.
        starting = asyncio.create_task(lifecycle.start(engine), name="qtrel-start")
        reload_models = on_loop(asyncio.get_running_loop(), engine.reload)  # SIGHUP: every model from its path
        lifecycle.reloaders.append(reload_models)
        # Jobs run beside the engine that owns the model processes: a one-process server's, else the engine
        # core's (service.core_main); every HTTP process has a desk that tells the runner what changed.
        jobs, runner = None, None
        if settings.jobs_dir is not None:
            if isinstance(engine, Engine):
                runner = JobRunner(settings, engine, metrics)
                await runner.start()  # its jobs wait for their model to be ready
            tell = runner.wake if runner is not None else engine.jobs_wake  # type: ignore[attr-defined]
            jobs = JobDesk(settings, engine.model_info, tell)
        try:
            # request.state, for service.http.deps
            yield {"engine": engine, "settings": settings, "metrics": metrics, "jobs": jobs}
        finally:
            lifecycle.reloaders.remove(reload_models)
            if runner is not None:
                await runner.stop(settings.drain_timeout_s)  # the running job resumes at the next start
            await engine.drain(settings.drain_timeout_s)
            starting.cancel()
            await engine.stop()
            tracing.shutdown()

    app = FastAPI(
        title="qtrel",
        version=package_version(),
        description="Query-title relevance: a BERT cross-encoder grading each pair on 5 levels.",
        lifespan=lifespan,
        # FastAPI's own OpenTelemetry looks up the global providers on every request (~3 us of a front's CPU);
        # qtrel's tracing is its own (service.tracing, FastAPI's contrib instrumentation), so without it: off
        telemetry=None if tracing.enabled else {"tracing": False, "metrics": False, "logs": False},
    )
    errors.install(app)
    auth = [Depends(require_api_key)] if settings.keys else []  # none: the OpenAPI schema shows no key
    explain_api, explain_page = explain_routers(settings)
    for protected in (*PROTECTED_ROUTERS, explain_api):
        app.include_router(protected, dependencies=auth)
    guard = require_admin_key if settings.keys or settings.admin_keyring.keys else admin_off
    app.include_router(admin_router, dependencies=[Depends(guard)])
    app.include_router(metrics_router, dependencies=auth if settings.protect_metrics else [])
    app.include_router(ops_router)  # health: always open
    app.include_router(explain_page)  # static; its /explain calls carry the key
    openapi.install(app, settings)  # the schema states the limits of the effective settings
    lifecycle.reloaders.append(settings.keyring.reload)  # SIGHUP: the key file re-read
    # A request's span comes from FastAPI's instrumentation: with tracing on, every request goes FastAPI's way.
    lane = FastLane(routes_of(app), app) if settings.fast_lane and not tracing.enabled else None
    app.state.fast_lane = lane
    app.add_middleware(
        EdgeMiddleware,
        metrics=metrics,
        max_body_bytes=settings.max_body_bytes,
        lane=lane,
        max_upload_bytes=settings.job_max_bytes + UPLOAD_SLACK
        if settings.jobs_dir is not None
        else settings.max_body_bytes,
    )
    tracing.instrument(app)  # a span per request, outside the edge middleware
    return app
