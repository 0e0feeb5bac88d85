"""`qtrel score` end to end through `service.cli.main`, on the tiny real checkpoint."""

from __future__ import annotations

import csv
import json

from model.relevance import RelevanceModel
from service.cli import main


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(x) for x in args])
    out, err = capsys.readouterr()
    return rc, out, err


def _write(path, rows: list[tuple[str, str]]):
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["search", "product", "level"])
        w.writerows([(q, t, "3") for q, t in rows])
    return path


PAIRS = [("cordless drill", "DEWALT 20V MAX Cordless Drill"), ("garden hose", "50 ft. Garden Hose"),
         ("angle bracket", "Simpson Strong-Tie 12-Gauge Angle"), ("rope", "nylon rope 50 ft"),
         ("paint", "interior paint, eggshell, 1 gal.")] * 3  # fmt: skip


def test_score_writes_the_scores_and_resumes(tiny_checkpoint, tmp_path, capsys):
    src, out = _write(tmp_path / "in.csv", PAIRS), tmp_path / "out.csv"
    args = ["score", src, "--out", out, "--model", tiny_checkpoint, "--query-column", "search", "--title-column",
            "product", "--prefix", "pred_", "--chunk-rows", "4", "--threads", "1", "--no-progress",
            "--dtype", "float32"]  # fmt: skip
    rc, stdout, err = _run(capsys, *args)
    assert rc == 0, err
    summary = json.loads(stdout)
    assert (summary["rows"], summary["scored"], summary["bad"]) == (15, 15, 0) and summary["pairs_per_s"] > 0
    with out.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["search", "product", "level", "pred_level", "pred_score",
                             *(f"pred_p_{x}" for x in "12345")]  # fmt: skip
    m = RelevanceModel.load(tiny_checkpoint)
    expected = m.predict(PAIRS)
    assert [r["pred_level"] for r in rows] == [m.labels[e.level] for e in expected]
    assert all(abs(float(r["pred_score"]) - e.expected) < 1e-5 for r, e in zip(rows, expected))

    full = out.read_bytes()
    rc, _, err = _run(capsys, *args)
    assert rc == 2 and "exists: pass --resume" in err
    out.write_bytes(full[: len(full) - 30])  # cut inside the last row
    rc, stdout, err = _run(capsys, *args, "--resume")
    assert rc == 0, err
    assert json.loads(stdout)["kept"] == 12 and out.read_bytes() == full


def test_score_reports_bad_rows_and_options(tiny_checkpoint, tmp_path, capsys):
    src = _write(tmp_path / "in.csv", [("drill", "DEWALT drill"), ("hose", "")])
    rc, _, err = _run(
        capsys,
        "score",
        src,
        "--out",
        tmp_path / "out.csv",
        "--model",
        tiny_checkpoint,
        "--query-column",
        "search",
        "--title-column",
        "product",
        "--prefix",
        "p.",
        "--no-progress",
    )
    assert rc == 2 and f"{src}:3: empty 'product'" in err and "--skip-bad" in err
    rc, _, err = _run(capsys, "score", src, "--out", tmp_path / "out2.csv", "--model", tiny_checkpoint)
    assert rc == 2 and "no column 'query'" in err and "--query-column" in err
    rc, _, err = _run(capsys, "score", src, "--out", tmp_path / "x.csv", "--model", "builtin:nope")
    assert rc == 2 and "no built-in model 'nope'" in err


def test_score_and_eval_take_the_servers_auto_dtype(tiny_checkpoint):
    """Without --dtype, `qtrel score` and `qtrel eval` run in the precision `qtrel serve` picks for this
    machine (bfloat16 where the CPU has AVX512-BF16 or AMX, float32 elsewhere)."""
    import argparse

    import torch

    from model.bulk.cli import add_score
    from model.device import resolve_dtype
    from model.train.cli import add_eval

    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    add_score(sub)
    add_eval(sub)
    parser = sub._name_parser_map  # the sub-parsers by command name
    assert parser["score"].parse_args(["in.csv", "--out", "o.csv"]).dtype == "auto"
    assert parser["eval"].parse_args(["m", "dev.csv"]).dtype == "auto"
    assert RelevanceModel.load(tiny_checkpoint, dtype="auto").dtype == resolve_dtype("auto", torch.device("cpu"))


def test_score_max_chunks_adds_the_window_columns_and_refuses_a_bad_value(tiny_checkpoint, tmp_path, capsys):
    src, out = _write(tmp_path / "in.csv", PAIRS[:3]), tmp_path / "out.csv"
    base = ["score", src, "--out", out, "--model", tiny_checkpoint, "--query-column", "search", "--title-column",
            "product", "--prefix", "pred_", "--no-progress", "--dtype", "float32"]  # fmt: skip
    rc, stdout, err = _run(capsys, *base, "--max-chunks", "3", "--chunk-overlap", "4")
    assert rc == 0, err
    assert json.loads(stdout)["forwarded"] == 3  # short titles: one window each
    with out.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["pred_windows"] for r in rows] == ["1.0"] * 3 and [r["pred_window"] for r in rows] == ["0.0"] * 3
    rc, _, err = _run(capsys, *base, "--overwrite", "--max-chunks", "0")
    assert rc != 0 and "max_chunks must be at least 1" in err


def test_score_on_two_workers_writes_the_one_thread_file_and_refuses_a_bad_count(tiny_checkpoint, tmp_path, capsys):
    import torch

    src = _write(tmp_path / "in.csv", PAIRS)
    base = ["score", src, "--model", tiny_checkpoint, "--query-column", "search", "--title-column", "product",
            "--prefix", "pred_", "--no-progress", "--dtype", "float32", "--max-batch-tokens", "64"]  # fmt: skip
    before = torch.get_num_threads()
    try:
        rc, _, err = _run(capsys, *base, "--out", tmp_path / "one.csv", "--threads", "1")
        assert rc == 0, err
        rc, _, err = _run(capsys, *base, "--out", tmp_path / "two.csv", "--threads", "2")  # 2 workers x 1 thread
        assert rc == 0, err
        rc, _, err = _run(capsys, *base, "--out", tmp_path / "bad.csv", "--workers", "-1")
    finally:
        torch.set_num_threads(before)
    assert (tmp_path / "two.csv").read_bytes() == (tmp_path / "one.csv").read_bytes()
    assert rc == 2 and "--workers must be 0" in err
