"""Bulk scoring of files (model.bulk.score) on the tiny real checkpoint: formats, order, chunking, restarts and
bad rows; the scores must be those of RelevanceModel.predict on the same pairs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from model.bulk.score import ScoreOptions, score_file
from model.data import DataError
from model.relevance import RelevanceModel

WORDS = (
    "cordless drill",
    "garden hose",
    "angle bracket",
    "LED bulb 60W",
    "copper pipe 1/2 in.",
    "paint roller",
    "shower head",
    "deck screws",
    'door knob "satin"',
    "weed killer, 1 gal.",
    "smoke detector",
    "rope",
)
LEVELS = ["1", "2", "3", "4", "5"]
SCORE_COLUMNS = ["level", "score", *(f"p_{x}" for x in LEVELS)]


def make_rows(n: int = 45) -> list[dict]:
    """Pairs of varied length, with commas, quotes, a newline inside a title and non-ASCII text."""
    rows = []
    for i in range(n):
        q = WORDS[i % len(WORDS)]
        t = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(1 + i % 9))
        if i == 5:
            t = "Bosch 18V drill\nwith two batteries"
        if i == 11:
            t = "Mischbatterie für Küche – Edelstahl"
        rows.append({"id": str(i), "query": q, "title": t, "note": f"row {i}"})
    return rows


def write_csv(path: Path, rows: list[dict], fields: list[str] | None = None) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields or list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with path.open(encoding="utf-8", newline="") as f:
        r = csv.DictReader(f)
        return list(r.fieldnames or []), list(r)


def assert_matches_predict(model: RelevanceModel, rows: list[dict], out: list[dict]) -> None:
    """Chunks form other batches than one predict call, so float32 sums differ in the last bits."""
    expected = model.predict([(r["query"], r["title"]) for r in rows])
    assert len(out) == len(expected)
    for o, e in zip(out, expected):
        assert o["level"] == model.labels[e.level]
        assert float(o["score"]) == pytest.approx(e.expected, abs=1e-5)
        assert [float(o[c]) for c in SCORE_COLUMNS[2:]] == pytest.approx(e.probs, abs=1e-5)


def test_csv_round_trip_keeps_columns_and_order_and_equals_predict(model, tmp_path):
    rows = make_rows()
    src = write_csv(tmp_path / "in.csv", rows)
    summary = score_file(model, src, tmp_path / "out.csv", chunk_rows=16, progress=False)
    assert summary["rows"] == summary["scored"] == len(rows) and summary["bad"] == summary["kept"] == 0
    header, out = read_csv(tmp_path / "out.csv")
    assert header == ["id", "query", "title", "note", *SCORE_COLUMNS]
    assert [{k: o[k] for k in rows[0]} for o in out] == rows  # every input column, unchanged, in input order
    assert_matches_predict(model, rows, out)
    assert all(sum(float(o[c]) for c in SCORE_COLUMNS[2:]) == pytest.approx(1, abs=1e-5) for o in out)


def test_jsonl_round_trip_keeps_every_key(model, tmp_path):
    rows = make_rows()
    for i, r in enumerate(rows):
        r["extra"] = {"rank": i, "tags": ["a", "b"]} if i % 2 else None
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    score_file(model, src, tmp_path / "out.jsonl", chunk_rows=10, progress=False)
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [list(o) for o in out] == [[*r, *SCORE_COLUMNS] for r in rows]
    assert [{k: o[k] for k in r} for o, r in zip(out, rows)] == rows
    assert all(isinstance(o["level"], str) and isinstance(o["p_1"], float) for o in out)
    assert_matches_predict(model, rows, out)


def test_chunk_size_does_not_change_the_scores(model, tmp_path):
    src = write_csv(tmp_path / "in.csv", make_rows())
    score_file(model, src, tmp_path / "small.csv", chunk_rows=7, progress=False)
    score_file(model, src, tmp_path / "one.csv", chunk_rows=1000, progress=False)
    (_, small), (_, one) = read_csv(tmp_path / "small.csv"), read_csv(tmp_path / "one.csv")
    assert [o["level"] for o in small] == [o["level"] for o in one]
    for a, b in zip(small, one):
        assert [float(a[c]) for c in SCORE_COLUMNS[1:]] == pytest.approx(
            [float(b[c]) for c in SCORE_COLUMNS[1:]], abs=1e-5
        )


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_resume_after_a_torn_write_gives_the_uninterrupted_file(model, tmp_path, suffix):
    rows = make_rows()
    src = (write_csv if suffix == ".csv" else write_jsonl)(tmp_path / f"in{suffix}", rows)
    ref = tmp_path / f"ref{suffix}"
    score_file(model, src, ref, chunk_rows=8, progress=False)
    full = ref.read_bytes()
    line_ends = [i + 1 for i, b in enumerate(full) if b == ord("\n")]
    # cut: inside the header (CSV) or first row, right after the first chunk (CSV: row 5 has two lines),
    # inside a row of a later chunk, in the last field of a row, the complete file
    cuts = (5, line_ends[9 if suffix == ".csv" else 7], line_ends[20] + 17, line_ends[30] - 2, len(full))
    for cut, kept in zip(cuts, (0, 8, 16, 24, 40)):  # rows kept: complete rows, down to a chunk boundary
        out = tmp_path / f"out{suffix}"
        out.write_bytes(full[:cut])
        summary = score_file(model, src, out, chunk_rows=8, resume=True, progress=False)
        assert out.read_bytes() == full, cut
        assert (summary["kept"], summary["scored"]) == (kept, len(rows) - kept), cut


def test_fix_the_bad_rows_and_resume(model, tmp_path):
    rows = make_rows()
    bad = [dict(r) for r in rows]
    bad[30]["title"] = "  "
    src = write_csv(tmp_path / "in.csv", bad)
    out = tmp_path / "out.csv"
    with pytest.raises(DataError) as e:
        score_file(model, src, out, chunk_rows=8, progress=False)
    # row 30 is on file line 33: the header, then a title over two lines (row 5)
    assert f"{src}:33: empty 'title'" in str(e.value) and "--skip-bad" in str(e.value)
    assert len(read_csv(out)[1]) == 24  # the three chunks before the bad one
    write_csv(src, rows)
    summary = score_file(model, src, out, chunk_rows=8, resume=True, progress=False)
    assert summary["kept"] == 24
    score_file(model, src, tmp_path / "ref.csv", chunk_rows=8, progress=False)
    assert out.read_bytes() == (tmp_path / "ref.csv").read_bytes()


def test_bad_rows_are_listed_with_file_and_line(model, tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("query,title\ndrill,DEWALT drill\n,a hose\nhose,\nrope,nylon rope,extra\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        score_file(model, src, tmp_path / "out.csv", progress=False)
    msg = str(e.value)
    assert "3 bad row(s)" in msg
    for where in (f"{src}:3: empty 'query'", f"{src}:4: empty 'title'", f"{src}:5: 3 fields, the header has 2"):
        assert where in msg
    jl = tmp_path / "in.jsonl"
    jl.write_text('{"query": "drill", "title": "drill"}\n[1, 2]\n{"query": "x"\n{"title": "t"}\n', encoding="utf-8")
    with pytest.raises(DataError) as e:
        score_file(model, jl, tmp_path / "out.jsonl", progress=False)
    for where in (f"{jl}:2: not a JSON object", f"{jl}:3: not JSON", f"{jl}:4: missing 'query'"):
        assert where in str(e.value)


def test_skip_bad_writes_empty_scores(model, tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("query,title\ndrill,DEWALT drill\n,a hose\nhose,garden hose\n", encoding="utf-8")
    summary = score_file(model, src, tmp_path / "out.csv", ScoreOptions(skip_bad=True), progress=False)
    assert (summary["scored"], summary["bad"], summary["rows"]) == (2, 1, 3)
    _, out = read_csv(tmp_path / "out.csv")
    assert all(out[1][c] == "" for c in SCORE_COLUMNS) and out[0]["level"] and out[2]["level"]
    jl = write_jsonl(tmp_path / "in.jsonl", [{"query": "drill", "title": ""}, {"query": "drill", "title": "drill"}])
    score_file(model, jl, tmp_path / "out.jsonl", ScoreOptions(skip_bad=True), progress=False)
    first = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert all(first[c] is None for c in SCORE_COLUMNS)


def test_column_names_and_prefix(model, tmp_path):
    rows = [{"q": r["query"], "t": r["title"], "level": "3"} for r in make_rows(10)]
    src = write_csv(tmp_path / "in.csv", rows)
    with pytest.raises(DataError, match="no column 'query'.*--query-column"):
        score_file(model, src, tmp_path / "a.csv", progress=False)
    with pytest.raises(ValueError, match="already has column.*'level'.*--prefix"):
        score_file(model, src, tmp_path / "b.csv", ScoreOptions(query_column="q", title_column="t"), progress=False)
    score_file(
        model, src, tmp_path / "c.csv", ScoreOptions(query_column="q", title_column="t", prefix="pred_"), progress=False
    )
    header, out = read_csv(tmp_path / "c.csv")
    assert header == ["q", "t", "level", *(f"pred_{c}" for c in SCORE_COLUMNS)]
    assert_matches_predict(
        model,
        [{"query": r["q"], "title": r["t"]} for r in rows],
        [{k.removeprefix("pred_"): v for k, v in o.items() if k != "level"} for o in out],
    )


def test_an_existing_output_needs_resume_or_overwrite(model, tmp_path):
    src = write_csv(tmp_path / "in.csv", make_rows(5))
    out = tmp_path / "out.csv"
    out.write_text("not ours\n")
    with pytest.raises(ValueError, match="exists: pass --resume"):
        score_file(model, src, out, progress=False)
    with pytest.raises(ValueError, match="not this run's"):
        score_file(model, src, out, resume=True, progress=False)
    score_file(model, src, out, ScoreOptions(overwrite=True), progress=False)
    assert len(read_csv(out)[1]) == 5
    with pytest.raises(ValueError, match="input's format"):
        score_file(model, src, tmp_path / "out.jsonl", progress=False)


def test_parquet_round_trip_and_resume(model, tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (pip install 'qtrel[bulk]')")
    import pyarrow.parquet as pq

    rows = make_rows()
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src, row_group_size=10)  # row groups unlike the chunks
    ref = tmp_path / "ref.parquet"
    score_file(model, src, ref, chunk_rows=8, progress=False)
    t = pq.read_table(ref)
    assert t.column_names == [*rows[0], *SCORE_COLUMNS]
    assert t.select(list(rows[0])).to_pylist() == rows
    assert_matches_predict(model, rows, t.to_pylist())
    assert pq.ParquetFile(ref).metadata.num_row_groups == 6  # one per chunk

    bad = [dict(r) for r in rows]
    bad[20]["query"] = None
    pq.write_table(pa.Table.from_pylist(bad), src)
    out = tmp_path / "out.parquet"
    with pytest.raises(DataError, match=f"{src}:21: missing 'query'"):
        score_file(model, src, out, chunk_rows=8, progress=False)
    parts = out.with_name("out.parquet.parts")
    assert not out.exists() and len(list(parts.glob("part-*.parquet"))) == 2
    (parts / "part-000002.parquet.tmp").write_bytes(b"torn")  # a crash while a part was being written
    pq.write_table(pa.Table.from_pylist(rows), src)
    assert score_file(model, src, out, chunk_rows=8, resume=True, progress=False)["kept"] == 16
    assert not parts.exists() and pq.read_table(out).equals(t)
    assert score_file(model, src, out, chunk_rows=8, resume=True, progress=False)["scored"] == 0  # finished
    assert pq.read_table(out).equals(t)


def test_real_pairs_equal_predict(model, tmp_path):
    from tests.conftest import shared_data

    dev = shared_data("homedepot", "dev.csv")
    with dev.open(encoding="utf-8") as f:
        head = [next(f) for _ in range(301)]
    src = tmp_path / "dev300.csv"
    src.write_text("".join(head), encoding="utf-8")
    score_file(model, src, tmp_path / "out.csv", ScoreOptions(prefix="pred_"), chunk_rows=128, progress=False)
    header, out = read_csv(tmp_path / "out.csv")
    assert header == ["query", "title", "relevance", "level", *(f"pred_{c}" for c in SCORE_COLUMNS)]
    assert_matches_predict(
        model, out, [{k.removeprefix("pred_"): v for k, v in o.items() if k != "level"} for o in out]
    )


def test_each_distinct_pair_is_forwarded_once_and_duplicates_get_its_very_row(model, tmp_path, monkeypatch):
    base = make_rows(20)
    rows = [dict(r, id=f"{r['id']}-{k}") for k in range(3) for r in base] + [dict(base[4], id="last")]
    distinct = list(dict.fromkeys((r["query"], r["title"]) for r in rows))
    encoded: list[int] = []
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda pairs, *a: encoded.append(len(pairs)) or encode(pairs, *a))
    summary = score_file(model, write_csv(tmp_path / "in.csv", rows), tmp_path / "out.csv", progress=False)
    monkeypatch.undo()  # the real model throughout: only its pairs were counted
    assert encoded == [len(distinct)] and summary["forwarded"] == len(distinct) < len(rows) == summary["rows"]
    _, out = read_csv(tmp_path / "out.csv")
    by_pair: dict[tuple[str, str], list[str]] = {}
    for r in out:
        by_pair.setdefault((r["query"], r["title"]), []).append(",".join(r[c] for c in SCORE_COLUMNS))
    assert all(len(set(v)) == 1 for v in by_pair.values())  # a duplicate is written as the same text
    assert_matches_predict(model, rows, out)
    # the same numbers as a file of the distinct pairs alone: folding changes no score
    once = [{"query": q, "title": t} for q, t in distinct]
    score_file(model, write_csv(tmp_path / "once.csv", once), tmp_path / "once-out.csv", progress=False)
    _, alone = read_csv(tmp_path / "once-out.csv")
    assert {(r["query"], r["title"]): ",".join(r[c] for c in SCORE_COLUMNS) for r in alone} == {
        k: v[0] for k, v in by_pair.items()
    }


def test_max_chunks_scores_long_titles_in_windows_and_names_the_best(model, tmp_path):
    from model.windows import split_pairs

    long = ", ".join(f"{w} {i}" for i, w in enumerate(WORDS * 8))  # ~300 word pieces
    rows = [{"query": "cordless drill", "title": long}, {"query": "rope", "title": "rope 50 ft"}]
    rows.append(dict(rows[0]))  # a duplicate: its windows are forwarded once
    out_path = tmp_path / "out.csv"
    options = ScoreOptions(max_chunks=5, chunk_overlap=8)
    summary = score_file(model, write_csv(tmp_path / "in.csv", rows), out_path, options, progress=False)
    columns, out = read_csv(out_path)
    assert columns[-4:] == ["window", "windows", "window_start", "window_end"]
    (windows, short) = split_pairs(model.tokenizer, ["cordless drill", "rope"], [long, "rope 50 ft"], 5, 8)
    assert len(windows) == 5 and len(short) == 1 and summary["forwarded"] == 6  # 5 windows + 1, not 11
    by_hand = model.predict([("cordless drill", w.text) for w in windows])
    k = max(range(5), key=lambda i: (by_hand[i].expected, -i))
    for r in (out[0], out[2]):
        assert [float(r[c]) for c in columns[-4:]] == [k, 5, windows[k].start, windows[k].end]
        assert long[int(float(r["window_start"])) : int(float(r["window_end"]))] == windows[k].text
        assert float(r["score"]) == pytest.approx(by_hand[k].expected, abs=1e-5)
        assert r["level"] == model.labels[by_hand[k].level]
    assert out[0] == out[2]
    assert [float(out[1][c]) for c in columns[-4:]] == [0, 1, 0, len("rope 50 ft")]
    assert float(out[1]["score"]) == pytest.approx(model.predict([("rope", "rope 50 ft")])[0].expected, abs=1e-5)
    with pytest.raises(ValueError, match="max_chunks"):
        ScoreOptions(max_chunks=0)
