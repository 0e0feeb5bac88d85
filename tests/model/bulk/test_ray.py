"""Bulk scoring on Ray Data (model.bulk.ray) in a local cluster of 2 CPUs, against the single-machine
`score_file` on the same file: same rows, same scores to 1e-5."""

from __future__ import annotations

import csv
import json

import pytest

from model.bulk.score import score_file
from model.relevance import RelevanceModel
from tests.model.bulk.test_score import SCORE_COLUMNS, make_rows, write_csv, write_jsonl

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'qtrel[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is missing: pip install 'qtrel[ray]'")

from model.bulk.ray import RayCluster, score_dataset_ray  # noqa: E402
from model.bulk.score import ScoreOptions  # noqa: E402

# A Ray Data pipeline that cannot get a CPU waits rather than fails: keep such a stall short.
pytestmark = pytest.mark.timeout(150)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def by_id(rows: list[dict]) -> dict[str, dict]:
    return {str(r["id"]): r for r in rows}


def assert_same_scores(ray_rows: list[dict], ref_rows: list[dict]) -> None:
    got, ref = by_id(ray_rows), by_id(ref_rows)
    assert set(got) == set(ref)
    for k, r in ref.items():
        g = got[k]
        assert (g["query"], g["title"], str(g["level"])) == (r["query"], r["title"], r["level"])
        assert [float(g[c]) for c in SCORE_COLUMNS[1:]] == pytest.approx([float(r[c]) for c in SCORE_COLUMNS[1:]],
                                                                         abs=1e-5)  # fmt: skip


def test_ray_csv_equals_the_single_machine_command(local_ray, tiny_checkpoint, tmp_path):
    rows = make_rows(60)
    src = write_csv(tmp_path / "in.csv", rows)
    score_file(RelevanceModel.load(tiny_checkpoint), src, tmp_path / "ref.csv", chunk_rows=16, progress=False)
    summary = score_dataset_ray(
        src,
        tmp_path / "out",
        tiny_checkpoint,
        cluster=RayCluster(num_actors=2, num_cpus=0.5, batch_size=16),
        dtype="float32",
    )
    assert summary["files"] >= 1
    got = []
    for part in sorted((tmp_path / "out").glob("*.csv")):
        with part.open(encoding="utf-8", newline="") as f:
            got += list(csv.DictReader(f))
    with (tmp_path / "ref.csv").open(encoding="utf-8", newline="") as f:
        ref = list(csv.DictReader(f))
    assert list(got[0]) == ["id", "query", "title", "note", *SCORE_COLUMNS]
    assert_same_scores(got, ref)


def test_ray_jsonl_in_order(local_ray, tiny_checkpoint, tmp_path):
    rows = make_rows(40)
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    score_file(RelevanceModel.load(tiny_checkpoint), src, tmp_path / "ref.jsonl", progress=False)
    score_dataset_ray(
        src,
        tmp_path / "out",
        tiny_checkpoint,
        cluster=RayCluster(num_actors=2, num_cpus=0.5, batch_size=8, preserve_order=True),
        dtype="float32",
    )
    got = [json.loads(line) for p in sorted((tmp_path / "out").glob("*.json*")) for line in p.open(encoding="utf-8")]
    ref = [json.loads(line) for line in (tmp_path / "ref.jsonl").open(encoding="utf-8")]
    assert sorted(int(g["id"]) for g in got) == list(range(40))
    assert_same_scores(got, ref)


def test_ray_refuses_a_pool_that_leaves_no_cpu_for_reading(local_ray, tiny_checkpoint, tmp_path):
    src = write_csv(tmp_path / "in.csv", make_rows(4))
    with pytest.raises(ValueError, match="2 actors x 1.0 CPUs leave less than one of the cluster's 2 CPUs"):
        score_dataset_ray(src, tmp_path / "out", tiny_checkpoint, cluster=RayCluster(num_actors=2, num_cpus=1.0))


def test_ray_refuses_bad_rows_unless_skipped(local_ray, tiny_checkpoint, tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("id,query,title\n0,drill,DEWALT drill\n1,hose,\n", encoding="utf-8")
    with pytest.raises(Exception, match="empty 'title'"):
        score_dataset_ray(src, tmp_path / "strict", tiny_checkpoint, cluster=RayCluster(num_actors=1, num_cpus=0.5))
    score_dataset_ray(
        src, tmp_path / "out", tiny_checkpoint, ScoreOptions(skip_bad=True), RayCluster(num_actors=1, num_cpus=0.5)
    )
    got = []
    for part in sorted((tmp_path / "out").glob("*.csv")):
        with part.open(encoding="utf-8", newline="") as f:
            got += list(csv.DictReader(f))
    levels = {r["id"]: r["level"] for r in got}
    assert levels["1"] == "" and levels["0"] in {"1", "2", "3", "4", "5"}
