"""`qtrel` command line: `serve` here, the model's commands from their wings (model/train/cli.py,
model/bulk/cli.py), merged into one parser. It parses and dispatches; the work is model/'s and the
service's. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import logging
import sys

from model.bulk import cli as bulk_cli
from model.train import cli as train_cli


def _add_serve(sub) -> None:
    from service.settings import Settings

    p = sub.add_parser("serve", help="start the scoring service (settings also from QTREL_* variables)")
    for name, f in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = (f.description or "") + f" [env QTREL_{name.upper()}, default {f.default!r}]"
        if f.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif name == "model":  # given several times, or as NAME=PATH: the models list
            p.add_argument(flag, dest=name, action="append", default=None, help=help_ + "; repeatable: NAME=PATH")
        else:
            p.add_argument(flag, dest=name, default=None, help=help_)


def serve(settings) -> int:
    """Run uvicorn on the app; SIGTERM turns readiness off at once, then drains and exits. A model that
    cannot be loaded at start ends the process with exit code 1 and a one-line reason on stderr, so that
    an orchestrator shows the crash and its message. SIGHUP never ends the server (it drops no work)."""
    import signal

    from service.runtime.layout import resolve_http_workers

    count, why = resolve_http_workers(settings)
    if count > 1:  # this process becomes the engine core behind `count` front processes
        from service.core_main import serve_core

        return serve_core(settings, count, why)
    from service.app import Lifecycle, create_app
    from service.logs import configure
    from service.runtime.layout import quiet_gc
    from service.server import http_server

    configure(settings.log_level, settings.log_json)
    lifecycle = Lifecycle()
    app = create_app(settings, lifecycle)
    quiet_gc()  # this process is the server's alone: keep the start-up objects out of the GC's scans
    server = http_server(app, settings, lifecycle, host=settings.host, port=settings.port)
    signal.signal(signal.SIGHUP, lambda sig, frame: lifecycle.hangup())
    server.run()
    if lifecycle.fatal:
        print(f"qtrel serve: {lifecycle.fatal}", file=sys.stderr)
        return 1
    return 0


def _cmd_serve(a) -> int:
    from pydantic import ValidationError

    from service.settings import Settings, parse_entry

    overrides = {k: v for k, v in vars(a).items() if k in Settings.model_fields and v is not None}
    if given := overrides.pop("model", None):  # the flag replaces QTREL_MODEL and QTREL_MODELS alike
        one = len(given) == 1 and parse_entry(given[0]).name is None  # a bare path or builtin, as before
        if one:
            overrides.update(model=given[0], models="")
        else:
            overrides.update(model=None, models=",".join(given))
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        print(f"qtrel serve: invalid settings:\n{e}", file=sys.stderr)
        return 2
    from model.builtin import resolve_model
    from service.settings import parse_models

    try:
        for entry in parse_models(settings.models) if settings.models else [parse_entry(settings.model or "")]:
            resolve_model(entry.path)
        if settings.shadow:
            resolve_model(parse_entry(settings.shadow).path)
    except FileNotFoundError as e:
        print(f"qtrel serve: {e}", file=sys.stderr)
        return 2
    return serve(settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qtrel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    for wing in (train_cli, bulk_cli):  # the model's commands: each wing's own parser
        wing.add_commands(sub)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from model.config import CheckpointError
    from model.data import DataError

    try:
        return {"serve": _cmd_serve, **train_cli.COMMANDS, **bulk_cli.COMMANDS}[a.command](a)
    except (DataError, CheckpointError) as e:
        print(f"qtrel {a.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
