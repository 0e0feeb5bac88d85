"""`qtrel eval` and `qtrel baseline` end to end through `service.cli.main`, on a tiny real checkpoint."""

from __future__ import annotations

import json

import pytest

from service.cli import main
from tests.conftest import shared_data

METRICS = {"n", "accuracy", "macro_f1", "qwk", "rmse_level", "ndcg@10", "per_level", "confusion", "rmse_relevance"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _head(src, dst, rows: int):
    with src.open(encoding="utf-8") as f:
        lines = [next(f) for _ in range(rows + 1)]
    dst.write_text("".join(lines), encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    return {
        "dev": _head(shared_data("homedepot", "dev.csv"), d / "dev100.csv", 100),
        "train": _head(shared_data("homedepot", "train.csv"), d / "train1500.csv", 1500),
        "dir": d,
    }


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(x) for x in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_eval_json_has_every_metric_and_writes_a_png(tiny_checkpoint, files, capsys, tmp_path):
    png = tmp_path / "figs" / "confusion.png"
    rc, out, _ = _run(capsys, "eval", tiny_checkpoint, files["dev"], "--json", "--png", png)
    assert rc == 0
    report = json.loads(out)  # nothing but JSON on stdout
    m = report["results"]["model"]
    assert set(m) == METRICS and m["n"] == 100
    assert sum(map(sum, m["confusion"])) == 100 and len(m["per_level"]) == 5
    assert report["labels"] == ["1", "2", "3", "4", "5"] and "baseline" not in report["results"]
    assert report["png"] == str(png)
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 5000


def test_eval_writes_a_reliability_diagram_and_ece_per_level(tiny_checkpoint, files, capsys, tmp_path):
    png = tmp_path / "reliability.png"
    rc, out, _ = _run(capsys, "eval", tiny_checkpoint, files["dev"], "--reliability-png", png)
    assert rc == 0 and f"reliability diagram: {png}" in out
    assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 5000
    rc, out, _ = _run(
        capsys, "eval", tiny_checkpoint, files["dev"], "--json", "--reliability-png", png, "--dtype", "float32"
    )
    ece = json.loads(out)["results"]["model"]["ece_per_level"]
    # the same figure worked out from the model's own probabilities on the same file
    from model.data import read_labelled
    from model.relevance import RelevanceModel
    from model.train.evaluate import score_dataset
    from model.train.metrics import reliability

    model = RelevanceModel.load(tiny_checkpoint)
    ds = read_labelled(files["dev"], model.labels)
    want = [lv["ece"] for lv in reliability(score_dataset(model, ds.examples).probs.tolist(), ds.labels)]
    assert len(ece) == 5 and ece == pytest.approx(want, abs=1e-4)


def test_eval_beside_the_baseline(tiny_checkpoint, files, capsys, tmp_path):
    rc, out, _ = _run(capsys, "eval", tiny_checkpoint, files["dev"], "--json", "--baseline-train", files["train"])
    assert rc == 0
    report = json.loads(out)
    assert set(report["results"]) == {"model", "baseline"}
    assert set(report["results"]["baseline"]) == METRICS
    assert report["systems"]["baseline"]["train_file"] == str(files["train"])

    png = tmp_path / "both.png"
    rc, out, _ = _run(capsys, "eval", tiny_checkpoint, files["dev"], "--baseline-train", files["train"], "--png", png)
    assert rc == 0
    headline = out.split("\n\n")[1]
    assert "model" in headline and "baseline" in headline and "qwk" in headline and "rmse_relevance" in headline
    assert "baseline: per level" in out and "precision" in out and "pred 5" in out
    assert png.read_bytes().startswith(PNG_MAGIC)


def test_baseline_command(files, capsys):
    rc, out, _ = _run(capsys, "baseline", files["train"], files["dev"], "--json")
    assert rc == 0
    m = json.loads(out)["results"]["baseline"]
    assert set(m) == METRICS and m["qwk"] > 0

    rc, out, _ = _run(capsys, "baseline", files["train"], files["dev"])
    assert rc == 0 and "level 5" in out and "true 1" in out


def test_label_map_and_labels(files, capsys, tmp_path):
    # Levels 1..5 folded onto three grades by --label-map, named by --labels.
    folded = json.dumps({"1": "bad", "2": "bad", "3": "fair", "4": "good", "5": "good"})
    rc, out, _ = _run(
        capsys, "baseline", files["train"], files["dev"], "--labels", "bad,fair,good", "--label-map", folded, "--json"
    )
    assert rc == 0
    m = json.loads(out)["results"]["baseline"]
    assert len(m["confusion"]) == 3 and m["n"] == 100


def _bad_label_file(tmp_path):
    """Three good rows, then a level 7 on line 5."""
    lines = shared_data("homedepot", "dev.csv").read_text(encoding="utf-8").splitlines()[:4]
    path = tmp_path / "bad.csv"
    path.write_text("\n".join([*lines, "angle grinder,DEWALT 4-1/2 in. Angle Grinder,3,7"]) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing data", "no such file"),
        ("missing model", "is not a directory"),
        ("bad label", "bad.csv:5: label '7' is not one of"),
        ("labels differ", "differ from the model's levels"),
        ("bad label map", "--label-map is not valid JSON"),
        ("bad device", "--device must be"),
        ("missing baseline train", "no such file"),
    ],
)
def test_bad_inputs_exit_non_zero_with_a_message(case, message, tiny_checkpoint, files, capsys, tmp_path):
    dev, ckpt = files["dev"], tiny_checkpoint
    args = {
        "missing data": ["eval", ckpt, tmp_path / "nope.csv"],
        "missing model": ["eval", tmp_path / "no-model", dev],
        "bad label": ["eval", ckpt, _bad_label_file(tmp_path)],
        "labels differ": ["eval", ckpt, dev, "--labels", "1,2,3"],
        "bad label map": ["eval", ckpt, dev, "--label-map", "{1: 2"],
        "bad device": ["eval", ckpt, dev, "--device", "tpu"],
        "missing baseline train": ["eval", ckpt, dev, "--baseline-train", tmp_path / "nope.csv"],
    }[case]
    rc, out, err = _run(capsys, *args)
    assert rc == 2
    assert message in err and err.startswith("qtrel eval: ")
    assert "Traceback" not in err and out == ""


def test_baseline_bad_inputs(files, capsys, tmp_path):
    rc, out, err = _run(capsys, "baseline", _bad_label_file(tmp_path), files["dev"])
    assert rc == 2 and "label '7'" in err and "Traceback" not in err and out == ""
    rc, out, err = _run(capsys, "baseline", files["train"], files["dev"], "--labels", "1")
    assert rc == 2 and "two or more distinct levels" in err
