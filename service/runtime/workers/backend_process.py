"""The process backend: the model lives in a child process, fed over a pipe.

The child is forked by multiprocessing's fork server, a single-threaded process that holds torch and the
served model loaded and warmed up (`service.runtime.workers.template`), so that the model processes share those
pages; it is never forked from the server, which runs threads. Where there is no fork server (not Linux),
and for cuda, the child is spawned and loads its own model.

The server's event loop, its tokeniser thread and the forward pass then never take turns on one GIL
(docs/design.md). Typed messages (`service.runtime.workers.backend`) cross the pipe: token ids in, scores out, a few KB.

What the process holds is explicit: `in_flight()` says which job it has had since when, so that a
watchdog can `kill` a process stuck in one (SIGKILL works on a stopped process too). A job whose
process died or was killed fails with `ProcessDied`, distinct from an error the model raised.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from service.runtime.layout import quiet_gc, release_free_memory
from service.runtime.workers.backend import (
    TEMPLATE_ENV,
    Answer,
    Backend,
    Done,
    Encoded,
    Error,
    Failed,
    Forward,
    Forwarded,
    Health,
    InFlight,
    Job,
    Loaded,
    LoadFailed,
    LoadSpec,
    ProcessDied,
    Ready,
    Stop,
    WarmUp,
    raise_for,
)
from service.runtime.workers.exchange import Exchange, OutOfStep

TEMPLATE_MODULE = "service.runtime.workers.template"  # imported by the fork server, never by this process
_start_lock = threading.Lock()  # the fork server's environment is os.environ while it starts

log = logging.getLogger("qtrel.worker")
PROBE_FIELDS = ("inference", "inference_reason", "inference_probe")  # what /info says of an `auto` choice
# Idle this long after a job, a model process hands the memory its batches freed back to the OS: glibc keeps it
# otherwise, ~50 MB a process after a few batches of 50 titles (Sapphire Rapids), a quarter of the server's idle PSS
IDLE_TRIM_S = 2.0


def child_main(conn, spec: LoadSpec, answer: Answer | None = None) -> None:
    """Entry point of the model process: load, then answer messages (`answer`, by default runner.handle)
    until Stop or until the server process goes away. Lifecycle signals are the server's to handle (it
    drains, or reloads, first)."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a terminal's hang-up reaches the group too
        signal.signal(sig, signal.SIG_IGN)
    from service.runtime.workers import runner, template  # torch and the model: here, never in the server process

    answer = answer or runner.handle

    try:
        base = template.take(spec)
        if base is None:
            model = runner.load_model(spec)
        else:  # forked from the fork server's copy: shared pages, no loading
            model = base.model
            runner.set_threads(spec.threads or base.default_threads)
        runner.start_inference(model, spec)  # here, after the fork: OpenVINO's thread pools are this process's
        conn.send(Loaded(model.describe()))
    except Exception as e:
        conn.send(Failed(f"{type(e).__name__}: {e}"))
        return
    busy = False  # a job ran since memory was last handed back
    while True:
        try:
            if busy and not conn.poll(IDLE_TRIM_S):
                release_free_memory()
                busy = False
            message = conn.recv()
        except (EOFError, OSError):
            return  # the server process is gone
        busy = True
        if isinstance(message, Stop):
            return
        if isinstance(message, WarmUp):
            try:
                runner.warm_up(model, spec, kernels=base is None or not base.warmed)
                quiet_gc()
                release_free_memory()
                conn.send(Ready())
            except Exception as e:
                conn.send(Failed(f"{type(e).__name__}: {e}"))
                return
            continue
        reply = answer(model, spec, message)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as e:  # a result that does not pickle: this job only
            conn.send(Error(type(e).__name__, str(e)))


def start_context(spec: LoadSpec):
    """The fork server (started, holding `spec`'s model as its template, if it is not running yet) where
    this platform has one and the spec is on cpu and asks for it; else spawn. Never a fork of this process:
    it runs threads."""
    forkserver_here = sys.platform == "linux" and "forkserver" in mp.get_all_start_methods()
    if not (spec.start == "template" and spec.device == "cpu" and forkserver_here):
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    with _start_lock:
        ctx.set_forkserver_preload([TEMPLATE_MODULE])
        extra = {TEMPLATE_ENV: json.dumps(dataclasses.asdict(spec))}
        # The fork server starts as `python -c ...`, which puts the working directory first on its path (its
        # Python 3.11 main ignores the parent's): a `model` or `service` package there would shadow qtrel's.
        if "PYTHONSAFEPATH" not in os.environ:
            extra["PYTHONSAFEPATH"] = "1"
        os.environ.update(extra)  # read by the fork server if this call starts it, and dropped at once
        try:
            forkserver.ensure_running()
        except OSError as e:  # e.g. no writable temporary directory for its socket
            log.warning("no fork server (%s: %s): model processes are spawned", type(e).__name__, e)
            return mp.get_context("spawn")
        finally:
            for k in extra:
                os.environ.pop(k, None)
    return ctx


class ProcessBackend(Backend):
    """`answer`: the model side of a message, if not runner.handle (picklable: a module-level function)."""

    def __init__(self, spec: LoadSpec, name: str = "qtrel-model", answer: Answer | None = None):
        self.spec = spec
        self.name = name
        self.answer = answer
        self._proc: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()  # guards the two fields below, read by the watchdog's thread
        self._in_flight: InFlight | None = None
        self._killed: str | None = None  # why this process was killed, if it was
        self._sock: Any = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def load(self) -> dict:
        info = self._start(self.spec)
        if self.spec.inference == "auto" and info.get("inference") == "torch" and info.get("inference_probe"):
            # The probe imported OpenVINO, whose libraries and pools stay in a process (~140 MB private on a Zen
            # 4) though torch serves: a fresh process with the choice pinned serves instead; /info keeps the probe.
            self.close()
            fresh = self._start(dataclasses.replace(self.spec, inference="torch"))
            info = {**fresh, **{k: info.get(k) for k in PROBE_FIELDS}}
        return info

    def _start(self, spec: LoadSpec) -> dict:
        ctx = start_context(spec)
        parent, child = ctx.Pipe()
        try:
            args = (child, spec, self.answer)
            proc = ctx.Process(target=child_main, args=args, name=self.name, daemon=True)
            proc.start()
        except Exception as e:  # e.g. no memory left to start a process
            raise LoadFailed(f"{type(e).__name__}: {e}", crashed=True) from e
        finally:
            child.close()  # so that the child's death reads as EOF here
        self._proc, self._conn = proc, parent
        if self.loop_driven:  # the same socket, for the event loop's non-blocking calls (MSG_DONTWAIT)
            self._sock = socket.fromfd(parent.fileno(), socket.AF_UNIX, socket.SOCK_STREAM)
        reply = self._await_start("loading")
        if not isinstance(reply, Loaded):
            raise LoadFailed(f"unexpected reply {type(reply).__name__} while loading")
        return reply.info

    def warm_up(self) -> None:
        try:
            self._conn.send(WarmUp())
        except (OSError, ValueError) as e:
            raise LoadFailed(f"the model process is gone ({e})", crashed=True) from e
        reply = self._await_start("warming up")
        if not isinstance(reply, Ready):
            raise LoadFailed(f"unexpected reply {type(reply).__name__} while warming up")

    def _await_start(self, what: str):
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise LoadFailed(
                f"the model process exited while {what} (exit code {self._proc.exitcode})", crashed=True
            ) from None
        if isinstance(reply, Failed):
            self._proc.join(5)
            raise LoadFailed(reply.reason)
        return reply

    def forward(self, batch: Sequence[Encoded]) -> Forwarded:
        return self._call(Forward(batch), "Forward")

    def job(self, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self._call(Job(name, args, kwargs or {}), f"Job:{name}")

    def _call(self, message: Forward | Job, kind: str) -> Any:
        with self._lock:
            self._in_flight = InFlight(kind, time.monotonic(), self._proc.pid)
        try:
            if self.loop_driven:  # uvloop's add_reader (libuv's uv_poll) leaves the pipe non-blocking
                os.set_blocking(self._conn.fileno(), True)
            self._conn.send(message)  # an argument that does not pickle raises here: this job only
            reply = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(1)
            raise ProcessDied(self._killed or "died", self._proc.exitcode) from None
        finally:
            with self._lock:
                self._in_flight = None
        return raise_for(reply)

    # The loop drives the pipe over a socket (exchange.py): multiprocessing's Pipe is a socket pair but on Windows.
    loop_driven = sys.platform != "win32"

    def start_on_loop(self, loop: Any, message: Forward | Job, done: Done) -> None:
        """`_call` driven by the event loop, never blocking it (`exchange.Exchange`): no thread to wake and
        none to wake the loop, which per batch halves what the hand-off costs the server process. The
        watchdog sees it in flight as any job. A process that died is reported at once, its exit code if it
        is known yet (the replica's thread joins it as it replaces it)."""
        proc = self._proc
        kind = "Forward" if isinstance(message, Forward) else f"Job:{message.name}"
        with self._lock:
            self._in_flight = InFlight(kind, time.monotonic(), proc.pid)

        def finish(reply: Any, error: BaseException | None) -> None:
            with self._lock:
                self._in_flight = None
            value: Any = None
            if error is None:
                try:
                    value = raise_for(reply)
                except Exception as e:
                    error = e
            elif isinstance(error, (EOFError, OSError)):
                if isinstance(error, OutOfStep):  # a replacement, with a new pipe, serves on
                    proc.kill()
                error = ProcessDied(self._killed or "died", proc.exitcode)  # exitcode: never waits
            done(value, error)

        try:
            Exchange(loop, self._sock, finish).start(message)
        except Exception as e:  # a message that does not pickle: nothing was sent
            with self._lock:
                self._in_flight = None
            loop.call_soon(done, None, e)

    def health(self) -> Health:
        if self._proc is None:
            return Health(False, "not started")
        if self._proc.is_alive():
            return Health(True)
        return Health(False, f"exit code {self._proc.exitcode}")

    def in_flight(self) -> InFlight | None:
        with self._lock:
            return self._in_flight

    def kill(self, reason: str, expected: InFlight) -> bool:
        with self._lock:
            if self._in_flight is not expected:
                return False  # that job finished meanwhile
            self._killed = reason
            try:
                os.kill(expected.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True

    def close(self) -> None:
        proc, conn = self._proc, self._conn
        if proc is None:
            return
        try:
            if proc.is_alive():
                conn.send(Stop())
        except (OSError, ValueError):
            pass
        proc.join(10)
        if proc.is_alive():  # stuck or stopped: SIGKILL works on both
            proc.kill()
            proc.join(5)
        conn.close()
        if self._sock is not None:
            self._sock.close()
