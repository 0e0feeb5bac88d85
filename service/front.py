"""A front process (`python -m service.front`, started by the engine core's supervisor, service.fronts):
the whole HTTP app -- routes, validation, API keys, tokenisation, response shaping, the request metrics --
on the shared port, with the engine core's proxy (service.runtime.remote) as its engine.

Its settings come down stdin as JSON; the core's Unix socket and the inherited port (or none: reuseport)
in its environment. It ends when the core ends (its connection closes), and on SIGTERM after finishing
the requests it holds. SIGHUP re-reads its key files; the models are the core's to reload.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from service.settings import Settings


def front_socket(settings: Settings) -> socket.socket:
    fd = os.environ.get("QTREL_FRONT_FD")
    if fd is not None:  # the core's listening socket, inherited
        return socket.socket(fileno=int(fd))
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)
    return sock


def main() -> int:
    from service.app import Lifecycle, create_app
    from service.logs import configure
    from service.runtime.layout import quiet_gc
    from service.runtime.remote import RemoteEngine
    from service.server import http_server

    settings = Settings(**json.loads(sys.stdin.read()))
    configure(settings.log_level, settings.log_json)
    core_path = os.environ["QTREL_CORE_SOCKET"]
    lifecycle = Lifecycle()
    engines: list[RemoteEngine] = []

    def remote(s, metrics, tracing):
        engine = RemoteEngine(s, metrics, core_path, tracing)
        engine.on_lost = core_gone
        engines.append(engine)
        return engine

    app = create_app(settings, lifecycle, engine_factory=remote)

    server = http_server(app, settings, lifecycle)

    def core_gone() -> None:
        lifecycle.fatal = "the engine core is gone"
        server.should_exit = True
        server.force_exit = True  # nobody can answer the requests held: end now

    def hangup(sig, frame) -> None:
        settings.keyring.reload()
        settings.admin_keyring.reload()

    signal.signal(signal.SIGHUP, hangup)
    quiet_gc()
    server.run(sockets=[front_socket(settings)])
    if lifecycle.fatal:
        print(f"qtrel front {os.getpid()}: {lifecycle.fatal}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
