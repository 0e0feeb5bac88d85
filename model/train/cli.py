"""`qtrel eval` and `qtrel baseline`: metrics of a checkpoint (and of the lexical baseline) on a labelled
file, as text or JSON, with a confusion-matrix PNG. Parsing and dispatch only; the work is model/'s."""

from __future__ import annotations

import json
import re
import sys

from model.device import add_device_options
from model.levels import DEFAULT_LEVELS, MAX_BATCH_TOKENS


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


def fail(a, message) -> int:
    print(f"qtrel {a.command}: {message}", file=sys.stderr)
    return 2


def _label_options(a) -> tuple[list[str] | None, dict[str, str] | None]:
    """--labels and --label-map, checked; ValueError says what is wrong."""
    labels = [s.strip() for s in a.labels.split(",")] if a.labels else None
    if labels is not None and (len(labels) < 2 or "" in labels or len(set(labels)) != len(labels)):
        raise ValueError(f"--labels needs two or more distinct levels, got {a.labels!r}")
    if not a.label_map:
        return labels, None
    try:
        label_map = json.loads(a.label_map)
    except json.JSONDecodeError as e:
        raise ValueError(f"--label-map is not valid JSON ({e})") from None
    if not isinstance(label_map, dict):
        raise ValueError('--label-map must be a JSON object such as {"0": "1"}')
    return labels, {str(k): str(v) for k, v in label_map.items()}


def _report(
    a, labels: list[str], results: dict, systems: dict, negatives: dict | None = None, notes: tuple[str, ...] = ()
) -> int:
    """Print the text or JSON report and write the PNG; shared by eval and baseline."""
    from model.train.report import confusion_png, text_report

    png = None
    if a.png:
        try:
            png = str(confusion_png(results, labels, a.png, title=a.data_file))
        except ImportError:
            return fail(a, "--png needs matplotlib (pip install 'qtrel[train]')")
        except OSError as e:
            return fail(a, f"cannot write {a.png}: {e}")
    if a.json:
        out = {"data": a.data_file, "labels": labels, "results": results, "systems": systems, "png": png}
        if negatives:
            out["negatives"] = negatives
        print(json.dumps(out, indent=2))
        return 0
    print(text_report(results, labels, a.data_file, negatives), end="")
    for name, meta in systems.items():
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in meta.items()))
    if png:
        print(f"confusion matrix: {png}")
    for line in notes:
        print(line)
    return 0


def _fit_baseline(a, train_file: str, labels: list[str], label_map: dict[str, str] | None):
    """(baseline, its description) fitted on train_file."""
    try:
        from model.train.baseline import LexicalBaseline
    except ImportError as e:
        raise ValueError(f"the baseline needs scikit-learn ({e}): pip install 'qtrel[train]'") from None
    baseline = LexicalBaseline(labels).fit_file(train_file, a.label_column, label_map)
    return baseline, {"train_file": train_file, "rounds": baseline.rounds}


def cmd_eval(a) -> int:
    from model.data import read_labelled
    from model.relevance import RelevanceModel
    from model.train.baseline import evaluate_baseline  # numpy only; scikit-learn is imported by the fit
    from model.train.evaluate import metrics_of, negatives_report, score_dataset
    from model.train.negatives import sample_negatives

    try:
        labels, label_map = _label_options(a)
        if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", a.device):
            raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {a.device!r}")
        model = RelevanceModel.load(a.model_dir, device=a.device, dtype=a.dtype, max_length=a.max_length)
        if labels is not None and labels != model.labels:
            raise ValueError(f"--labels {','.join(labels)} differ from the model's levels {','.join(model.labels)}")
        labels = model.labels
        ds = read_labelled(a.data_file, labels, a.label_column, label_map)
        if a.baseline_train:
            baseline, baseline_meta = _fit_baseline(a, a.baseline_train, labels, label_map)
    except ValueError as e:
        return fail(a, e)
    judged = score_dataset(model, ds.examples, a.max_batch_tokens)
    results = {"model": metrics_of(ds, judged)}
    systems = {
        "model": {
            "checkpoint": a.model_dir,
            "device": str(model.device),
            "dtype": model.dtype,
            "level_rule": model.rule.name,
        }
    }
    negatives = {}
    if a.negatives:
        negs = sample_negatives(ds, a.negatives, seed=a.seed)
        negatives["model"] = negatives_report(ds, judged, negs, score_dataset(model, negs, a.max_batch_tokens))
    if a.baseline_train:
        results["baseline"] = evaluate_baseline(baseline, ds)
        systems["baseline"] = baseline_meta
    notes: tuple[str, ...] = ()
    if a.reliability_png:
        from model.train.metrics import reliability
        from model.train.report import reliability_png

        per_level = reliability(judged.probs.tolist(), ds.labels)
        results["model"]["ece_per_level"] = [round(lv["ece"], 4) for lv in per_level]
        try:
            reliability_png(per_level, labels, a.reliability_png, title=f"{a.model_dir} on {a.data_file}")
        except ImportError:
            return fail(a, "--reliability-png needs matplotlib (pip install 'qtrel[train]')")
        except OSError as e:
            return fail(a, f"cannot write {a.reliability_png}: {e}")
        ece = ", ".join(f"{lab} {v:.3f}" for lab, v in zip(labels, results["model"]["ece_per_level"]))
        notes = (f"reliability diagram: {a.reliability_png} (ECE per level: {ece})",)
    return _report(a, labels, results, systems, negatives, notes)


def cmd_baseline(a) -> int:
    from model.data import read_labelled
    from model.train.baseline import evaluate_baseline

    try:
        labels, label_map = _label_options(a)
        labels = labels or list(DEFAULT_LEVELS)
        ds = read_labelled(a.data_file, labels, a.label_column, label_map)
        baseline, meta = _fit_baseline(a, a.train_file, labels, label_map)
    except ValueError as e:
        return fail(a, e)
    return _report(a, labels, {"baseline": evaluate_baseline(baseline, ds)}, {"baseline": meta})
