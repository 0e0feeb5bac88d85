"""model/train/cutoffs.py: what a cut-off keeps, against counts worked out by hand, and its command on real data."""

from __future__ import annotations

import pytest

from model.train.cutoffs import level_rows, main, score_rows, table
from tests.conftest import shared_data

LABELS = ["1", "2", "3", "4", "5"]


def test_level_rows_by_hand():
    # model levels (class indices) and a person's, six pairs
    pred = [0, 1, 3, 4, 4, 2]
    human = [0, 3, 3, 2, 4, 4]
    rows = {r.cut: r for r in level_rows(pred, human, LABELS)}
    ge4 = rows["level >= 4"]  # the model keeps pairs 2, 3, 4; a person graded 1, 2, 4, 5 >= 4
    assert ge4.kept == 3 / 6 and ge4.precision == 2 / 3 and ge4.recall == 2 / 4 and ge4.base == 4 / 6
    ge2 = rows["level >= 2"]
    assert ge2.kept == 5 / 6 and ge2.precision == 1.0 and ge2.recall == 1.0
    assert list(rows) == ["level >= 2", "level >= 3", "level >= 4", "level >= 5"]


def test_score_rows_and_an_empty_cut():
    rows = score_rows([3.0, 4.5, 2.0, 4.0], [3, 4, 0, 1], target=3, labels=LABELS, cuts=[4.0, 5.0])
    assert (rows[0].kept, rows[0].precision, rows[0].recall) == (0.5, 0.5, 0.5)
    assert rows[1].kept == 0 and rows[1].precision is None
    assert "| score >= 5 | 0.0% | – | 0.0% | 50.0% |" in table(rows)


def test_the_command_on_real_rows(tiny_checkpoint, tmp_path, capsys):
    src = shared_data("homedepot", "dev.csv")
    head = tmp_path / "dev200.csv"
    head.write_text("".join(src.open(encoding="utf-8").readlines()[:201]), encoding="utf-8")
    assert main([str(head), "--model", str(tiny_checkpoint), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "200 pairs" in out and "| level >= 5 |" in out and "| score >= 4 |" in out


def test_an_unknown_target_level_is_refused(tiny_checkpoint, tmp_path, capsys):
    f = tmp_path / "d.csv"
    f.write_text("query,title,level\ndrill,cordless drill,5\n", encoding="utf-8")
    with pytest.raises(SystemExit):
        main([str(f), "--model", str(tiny_checkpoint), "--dtype", "float32", "--target", "9"])
    assert "--target '9' is not a level of tiny-bert" in capsys.readouterr().err
