"""`qtrel serve` with several front processes: this process is the engine core. It loads the models,
serves the engine to the fronts (service.runtime.core), starts and replaces them (service.fronts), runs
the score jobs (service.jobs.runner), and drains on SIGTERM: readiness off at once, the fronts finish the
requests they hold and exit, the queues drain, the model processes end. SIGHUP reloads every model (and
the fronts re-read their key files). A model that cannot be loaded at start ends the server with exit
code 1 and a one-line reason."""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import sys
import tempfile

from service.fronts import Fronts
from service.jobs.runner import JobRunner
from service.metrics import Metrics
from service.runtime.core import STATE_EVERY_S, CoreServer, run_loop
from service.runtime.engine import Engine
from service.runtime.layout import quiet_gc
from service.runtime.models import Models
from service.settings import Settings
from service.tracing import from_env as tracing_from_env

log = logging.getLogger("qtrel.core")


async def run_core(settings: Settings, count: int, why: str) -> str | None:
    """Serve until SIGTERM (None) or until a model cannot be loaded (why)."""
    loop = asyncio.get_running_loop()
    folder = tempfile.mkdtemp(prefix="qtrel-core-")
    core_path = f"{folder}/core.sock"
    try:
        fronts = Fronts(settings, count, core_path, why)  # the port, first: a port in use ends the start here
    except OSError as e:
        shutil.rmtree(folder, ignore_errors=True)
        return f"cannot listen on {settings.host}:{settings.port}: {e}"
    tracing = tracing_from_env()
    metrics = Metrics()
    engine = Engine(settings, Models(settings, metrics, tracing), metrics, tracing=tracing)
    core = CoreServer(engine, core_path, health=fronts.health)
    core.describe_fronts = fronts.describe
    runner = JobRunner(settings, engine, metrics) if settings.jobs_dir is not None else None
    if runner is not None:  # score jobs run here, beside the model processes; the fronts' desks wake it
        await runner.start()  # before the fronts: it clears cut-off uploads, and their jobs_wake finds it
        core.jobs_wake = runner.wake
    await core.start()
    fronts.start()  # they answer 503 while the models load, as one process does
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    running: set[asyncio.Task] = set()

    def hangup() -> None:
        task = asyncio.ensure_future(engine.reload())
        running.add(task)
        task.add_done_callback(running.discard)
        settings.keyring.reload()
        fronts.signal(signal.SIGHUP)  # each front re-reads its key files

    loop.add_signal_handler(signal.SIGHUP, hangup)

    async def supervise() -> None:  # replace fronts that die, from the start (also while models load)
        while True:
            fronts.check()
            await asyncio.sleep(STATE_EVERY_S)

    async def collect() -> None:  # the fronts' metric samples every second: a killed front loses at most that
        while True:
            await core.collect_fronts()
            await asyncio.sleep(1.0)

    supervising = asyncio.ensure_future(supervise())
    collecting = asyncio.ensure_future(collect())
    starting = asyncio.ensure_future(engine.start())
    stopping = asyncio.ensure_future(stop.wait())
    fatal: str | None = None
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and (fatal := starting.result()) is not None:
            log.critical(fatal)
        else:
            if starting.done():
                quiet_gc()  # the models' objects too: the GC's scans of them were ~1/4 of the core's CPU
            await stopping  # serve until SIGTERM
        supervising.cancel()
        collecting.cancel()
        core.draining = True
        core.push()  # the fronts' readiness goes off before they are told to stop
        if runner is not None:
            await runner.stop(settings.drain_timeout_s)  # the running job resumes at the next start
        clean = await asyncio.to_thread(fronts.stop, 0.0 if fatal else settings.drain_timeout_s)
        if not clean and not fatal:
            log.warning("a front process did not finish its requests within drain_timeout_s")
        engine.begin_drain()  # only now: the requests the fronts held were still taken
        await engine.drain(settings.drain_timeout_s)
        if running:  # a SIGHUP's reload under way: its new model processes must not outlive the server
            await asyncio.wait(running, timeout=settings.drain_timeout_s)
    finally:
        supervising.cancel()
        collecting.cancel()
        starting.cancel()
        stopping.cancel()
        await core.stop()
        await engine.stop()
        tracing.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    return fatal


def serve_core(settings: Settings, count: int, why: str) -> int:
    from service.logs import configure

    configure(settings.log_level, settings.log_json)
    quiet_gc()
    fatal = run_loop(run_core(settings, count, why))
    if fatal:
        print(f"qtrel serve: {fatal}", file=sys.stderr)
        return 1
    log.info("Application shutdown complete.")
    return 0
