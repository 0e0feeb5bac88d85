"""The front processes' supervisor, in the engine core: how many fronts (`--http-workers`), the port they
share, starting them, replacing one that dies, the crash-loop rule, and ending them on drain.

Each front (service.front) is a new interpreter: it reads its settings from a pipe (the API keys are
never in its environment), connects to the core's Unix socket and serves HTTP on the shared port.

The port: `reuseport` (the default) gives each front its own socket on the port (SO_REUSEPORT): the
kernel spreads connections by a hash of their addresses, evenly; a front that dies drops the connections
waiting on its socket. `shared` is one listening socket the core opens and every front inherits; the
kernel hands each new connection to whichever front accepts first, so one front may take most of a burst
of new connections, and a front that dies leaves its waiting connections to the others. Measured with 64
keep-alive clients: the fronts' CPU 1.05:1 with reuseport, 2:1 shared (docs/fronts-bench.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque

from pydantic import SecretStr

from service.runtime.workers.replica import RestartPolicy
from service.settings import Settings

log = logging.getLogger("qtrel.fronts")

# Fronts restart at once up to `free` times a minute, then back off; `crash_loop` restarts a minute fail
# liveness (the orchestrator replaces the pod), as for model processes but sooner: a front has no model to
# lose, and one that keeps dying is a bug, not a kill storm.
FRONT_POLICY = RestartPolicy(window_s=60.0, free=4, max_backoff_s=10.0, crash_loop=6)
BACKLOG = 2048
QTREL_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # the folder holding `service`


def listening_socket(host: str, port: int, reuseport: bool) -> socket.socket:
    """The port's socket: listening and inheritable (shared), or bound with SO_REUSEPORT, not listening,
    holding the port (and choosing it when `port` is 0) for the fronts' own sockets (reuseport)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if reuseport and port:
        # SO_REUSEPORT would let this server join another's listening group on the port (same user) and
        # silently take half its connections: a plain bind first fails as a port in use does for one process
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (a restart's TIME_WAITs are no owner)
            probe.bind((host, port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if not reuseport:
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
    return sock


def settings_for_front(settings: Settings, port: int) -> str:
    """The settings as JSON, secrets included (sent down a pipe, never put in an environment)."""
    out = {}
    for name, value in settings.model_dump().items():
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, os.PathLike):
            value = os.fspath(value)
        out[name] = value
    out.update(http_workers=1, port=port)
    return json.dumps(out)


class Fronts:
    """N front processes on one port: started, replaced when one dies, stopped on drain."""

    def __init__(self, settings: Settings, count: int, core_path: str, why: str = "set"):
        self.settings = settings
        self.count = count
        self.why = why
        self.core_path = core_path
        self.reuseport = settings.http_socket == "reuseport"
        self.sock = listening_socket(settings.host, settings.port, self.reuseport)
        self.port = self.sock.getsockname()[1]
        self.procs: list[subprocess.Popen | None] = [None] * count
        self._due: list[float] = [0.0] * count  # when a dead front may be started again (backoff)
        self._restarts: deque[float] = deque()
        self.restarts = 0
        self.stopping = False

    def _spawn(self, i: int) -> None:
        env = {**os.environ, "QTREL_CORE_SOCKET": self.core_path, "QTREL_FRONT_INDEX": str(i)}
        # `python -m` puts the working directory first on the path: a user's own `service` or `model`
        # package there would shadow qtrel's (as for the model processes' fork server), unless it is qtrel's
        if os.path.realpath(os.getcwd()) != QTREL_ROOT:
            env.setdefault("PYTHONSAFEPATH", "1")
        env.pop("QTREL_API_KEYS", None)
        env.pop("QTREL_ADMIN_KEYS", None)
        fds: tuple[int, ...] = ()
        if not self.reuseport:
            env["QTREL_FRONT_FD"] = str(self.sock.fileno())
            fds = (self.sock.fileno(),)
        p = subprocess.Popen([sys.executable, "-m", "service.front"], stdin=subprocess.PIPE, env=env, pass_fds=fds)
        assert p.stdin is not None
        p.stdin.write(settings_for_front(self.settings, self.port).encode())
        p.stdin.close()
        self.procs[i] = p

    def start(self) -> None:
        for i in range(self.count):
            self._spawn(i)
        log.info("%d front processes on port %d (%s socket)", self.count, self.port, self.settings.http_socket)

    def recent_restarts(self) -> int:
        cut = time.monotonic() - FRONT_POLICY.window_s
        while self._restarts and self._restarts[0] < cut:
            self._restarts.popleft()
        return len(self._restarts)

    def check(self) -> None:
        """Replace each front that has died (called every ~0.1 s by the core), backing off in a crash loop."""
        if self.stopping:
            return
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if p is None or p.poll() is None:
                continue
            if self._due[i] == 0.0:
                self._restarts.append(now)
                self.restarts += 1
                delay = FRONT_POLICY.delay(self.recent_restarts())
                self._due[i] = now + delay
                log.error("front %d (pid %d) exited with %s; restarting in %.0f s", i, p.pid, p.returncode, delay)
            if now >= self._due[i]:
                self._due[i] = 0.0
                self._spawn(i)

    def health(self) -> tuple[bool, str]:
        if (n := self.recent_restarts()) >= FRONT_POLICY.crash_loop:
            return False, f"crash loop: front processes restarted {n} times in {FRONT_POLICY.window_s:.0f} s"
        return True, ""

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]

    def describe(self) -> dict:
        return {
            "http_workers": self.count,
            "chosen": self.why,
            "socket": self.settings.http_socket,
            "pids": self.pids(),
            "restarts": self.restarts,
        }

    def signal(self, sig: int) -> None:
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(sig)

    def stop(self, timeout: float) -> bool:
        """SIGTERM every front (each finishes its requests in flight, then exits) and wait up to `timeout`;
        a front still running then is killed. True if every one ended by itself. Blocking: run in a thread."""
        self.stopping = True
        self.signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        clean = True
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                clean = False
                p.kill()
                p.wait()
        self.sock.close()
        return clean
