"""read_labelled: CSV and JSON lines, strict row checks reported as file:line, label columns and maps."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from model.data import DataError, read_labelled
from tests.conftest import shared_data

LEVELS = ["1", "2", "3", "4", "5"]


def write_jsonl(path, rows) -> None:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows), encoding="utf-8"
    )


def test_csv(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text(
        "query,title,relevance,level\n"
        "angle bracket,Simpson Strong-Tie 12-Gauge Angle,3,5\n"
        'deck over,"Behr Premium 1-gal. #SC-141 Tugboat Wood and Concrete Coating, Deck Over",2.33,4\n'
        "drill,Cordless Drill,,1\n",
        encoding="utf-8",
    )
    ds = read_labelled(path, LEVELS)
    assert len(ds) == 3 and ds.path == str(path)
    assert ds.labels == [4, 3, 0]  # class index = level - 1
    assert ds.pairs[1] == ("deck over", "Behr Premium 1-gal. #SC-141 Tugboat Wood and Concrete Coating, Deck Over")
    assert [e.relevance for e in ds.examples] == [3.0, 2.33, None]


def test_json_lines(tmp_path):
    path = tmp_path / "dev.jsonl"
    write_jsonl(
        path,
        [
            {"id": 0, "query": "小孩咳嗽感冒", "title": "小孩感冒过后久咳嗽该吃什么药", "label": "1"},
            {"id": 1, "query": "q", "title": "t", "label": 2},  # a number, not a string
            {"id": 2, "query": "q", "title": "t", "label": 0.0},  # a whole float
        ],
    )
    ds = read_labelled(path, ["0", "1", "2"], label_column="label")
    assert ds.labels == [1, 2, 0]
    assert ds.examples[0].query == "小孩咳嗽感冒"
    assert all(e.relevance is None for e in ds.examples)


def test_label_map(tmp_path):
    # QBQTC's three grades onto the five levels: 0 -> 1, 1 -> 3, 2 -> 5.
    path = tmp_path / "dev.json"
    write_jsonl(path, [{"query": "q", "title": f"t{g}", "label": str(g)} for g in (0, 1, 2, 1)])
    ds = read_labelled(path, LEVELS, label_column="label", label_map={"0": "1", "1": "3", "2": "5"})
    assert ds.labels == [0, 2, 4, 2]


def test_named_labels(tmp_path):
    path = tmp_path / "named.csv"
    path.write_text("query,title,grade\nq,a,bad\nq,b,good\nq,c,ok\n")
    ds = read_labelled(path, ["bad", "ok", "good"], label_column="grade")
    assert ds.labels == [0, 2, 1]


def test_bad_csv_rows_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(
        "query,title,relevance,level\n"  # line 1
        "ok,fine title,3,5\n"  # line 2
        "no title here\n"  # line 3: too few fields
        ",empty query,2,3\n"  # line 4
        "empty title,   ,2,3\n"  # line 5
        "range,label too high,3,7\n"  # line 6
        "fine,again,1,1\n",  # line 7
        encoding="utf-8",
    )
    with pytest.raises(DataError) as e:
        read_labelled(path, LEVELS)
    msg = str(e.value)
    assert f"4 bad row(s) in {path}" in msg
    assert f"{path}:3: missing column 'title'" in msg
    assert f"{path}:4: empty query" in msg
    assert f"{path}:5: empty title" in msg
    assert f"{path}:6: label '7' is not one of {LEVELS}" in msg
    assert f"{path}:2" not in msg and f"{path}:7" not in msg


def test_missing_label_column_is_reported(tmp_path):
    path = tmp_path / "nolabel.csv"
    path.write_text("query,title,score\nq,t,3\n")
    with pytest.raises(DataError, match=rf"{path}:2: missing column 'level'"):
        read_labelled(path, LEVELS)


def test_bad_json_lines_are_reported_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    write_jsonl(
        path,
        [
            {"query": "q", "title": "t", "level": 3},  # line 1: fine
            "",  # line 2: blank, skipped but counted
            "{not json",  # line 3
            '["a", "list"]',  # line 4
            {"query": "q", "level": 3},  # line 5
            {"query": "q", "title": "t", "level": 0},  # line 6
            {"query": "q", "title": "t", "level": None},  # line 7
        ],
    )
    with pytest.raises(DataError) as e:
        read_labelled(path, LEVELS)
    msg = str(e.value)
    assert f"{path}:3: " in msg
    assert f"{path}:4: not a JSON object" in msg
    assert f"{path}:5: missing column 'title'" in msg
    assert f"{path}:6: label 0 is not one of" in msg
    assert f"{path}:7: missing column 'level'" in msg
    assert f"{path}:1" not in msg and f"{path}:2" not in msg


def test_error_list_stops_at_max_errors(tmp_path):
    path = tmp_path / "many.csv"
    path.write_text("query,title,level\n" + "q,t,9\n" * 30)
    with pytest.raises(DataError) as e:
        read_labelled(path, LEVELS, max_errors=5)
    msg = str(e.value)
    assert "5 bad row(s)" in msg and "stopped at the first 5" in msg
    assert msg.count("label '9' is not one of") == 5
    assert f"{path}:6:" in msg and f"{path}:7:" not in msg


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_labelled(tmp_path / "absent.csv", LEVELS)
    (tmp_path / "header.csv").write_text("query,title,level\n")
    with pytest.raises(DataError, match="no rows"):
        read_labelled(tmp_path / "header.csv", LEVELS)


def test_unparsable_relevance_is_dropped_not_fatal(tmp_path):
    path = tmp_path / "rel.csv"
    path.write_text("query,title,relevance,level\nq,t,high,2\n")
    assert read_labelled(path, LEVELS).examples[0].relevance is None


def test_real_files_read_whole():
    # Level counts published in ../shared/data/README.md.
    dev = read_labelled(shared_data("homedepot", "dev.csv"), LEVELS)
    assert len(dev) == 7206
    assert [Counter(dev.labels)[c] for c in range(5)] == [234, 934, 1158, 3041, 1839]
    assert all(e.relevance is not None and 1 <= e.relevance <= 3 for e in dev.examples)
    qb = read_labelled(shared_data("qbqtc", "dev.json"), ["0", "1", "2"], label_column="label")
    assert [Counter(qb.labels)[c] for c in range(3)] == [4894, 12592, 2514]
