"""Score jobs (/v1/jobs) through the real app on the tiny checkpoint: every route, every refusal, and the
output byte for byte what `qtrel score` writes for the same file, model and precision."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path

import httpx
import pytest

from service.cli import main
from tests.service.conftest import live_server

WORDS = "cordless drill garden hose angle bracket nylon rope interior paint eggshell copper pipe fitting".split()


def make_pairs(n: int, long_every: int = 7) -> list[tuple[str, str]]:
    """Varied pairs, some repeated (folded duplicates), some titles longer than the tiny model's window."""
    out = []
    for i in range(n):
        q = " ".join(WORDS[(i * k) % len(WORDS)] for k in (1, 3))
        words = 4 + (i % 9) + (150 if i % long_every == 0 else 0)
        out.append((q, " ".join(WORDS[(i + k * 5) % len(WORDS)] for k in range(words))))
    return out + out[:5]


def write_input(path: Path, pairs: list[tuple[str, str]]) -> Path:
    rows = [{"id": str(i), "query": q, "title": t} for i, (q, t) in enumerate(pairs)]
    if path.suffix == ".csv":
        with path.open("w", encoding="utf-8", newline="") as f:
            w = csv.DictWriter(f, ["id", "query", "title"])
            w.writeheader()
            w.writerows(rows)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def qtrel_score(model_dir: Path, src: Path, out: Path, *extra: str) -> bytes:
    """The reference: `qtrel score` at the server's precision (the live server's float32)."""
    args = ["score", str(src), "--out", str(out), "--model", str(model_dir), "--dtype", "float32", "--no-progress"]
    assert main([*args, "--threads", "1", *extra]) == 0
    return out.read_bytes()


def wait_finished(client: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish: {job}")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("jobs")
    (root / "allowed").mkdir()
    (root / "other").mkdir()
    return root


@pytest.fixture(scope="module")
def server(tiny_checkpoint, dirs):
    with live_server(
        tiny_checkpoint,
        max_wait_ms=5,
        jobs_dir=dirs / "jobs",
        job_input_dirs=str(dirs / "allowed"),
        job_max_rows=5000,
        job_max_bytes=2_000_000,
        job_min_free_bytes=0,
    ) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    "suffix,how,extra",
    [
        (".csv", "multipart", {}),
        (".jsonl", "raw", {"max_chunks": 3, "chunk_rows": 50}),
        (".parquet", "path", {"chunk_rows": 64, "prefix": "pred_"}),
        (".csv", "raw", {"truncation": "longest_first", "chunk_rows": 7}),
    ],
)
def test_output_is_what_qtrel_score_writes(client, server, tiny_checkpoint, dirs, tmp_path, suffix, how, extra):
    src = write_input((dirs / "allowed" if how == "path" else tmp_path) / f"pairs{how}{suffix}", make_pairs(300))
    if how == "multipart":
        fields = {k: str(v) for k, v in extra.items()}
        r = client.post("/v1/jobs", files={"file": (src.name, src.read_bytes())}, data=fields)
    elif how == "raw":
        params = {"filename": src.name, **{k: str(v) for k, v in extra.items()}}
        r = client.post("/v1/jobs", content=src.read_bytes(), params=params)
    else:
        r = client.post("/v1/jobs", json={"input_path": str(src), **extra})
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["object"] == "job" and job["status"] in ("queued", "in_progress") and job["id"].startswith("job_")
    assert job["request_counts"]["total"] == 305 and job["dtype"] == "float32"
    done = wait_finished(client, job["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 305, "completed": 305, "failed": 0}
    assert done["completed_at"] >= done["in_progress_at"] >= done["created_at"]
    got = client.get(done["output"]["url"])
    assert got.status_code == 200 and len(got.content) == done["output"]["bytes"]
    flags = []
    for k, v in extra.items():
        if k != "truncation":
            flags += [f"--{k.replace('_', '-')}", str(v)]
    # qtrel score has no truncation option: with these short queries longest_first cuts what only_second cuts
    assert got.content == qtrel_score(tiny_checkpoint, src, tmp_path / f"ref{suffix}", *flags)


def test_list_get_cancel_delete(client, server, tmp_path):
    src = write_input(tmp_path / "many.csv", make_pairs(2000))
    ids = []
    for _ in range(3):
        r = client.post("/v1/jobs", content=src.read_bytes(), params={"filename": "many.csv", "chunk_rows": "100"})
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    page = client.get("/v1/jobs", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True and len(page["data"]) == 2
    assert [j["id"] for j in page["data"]] == [ids[2], ids[1]]  # newest first
    assert page["first_id"] == ids[2] and page["last_id"] == ids[1]
    rest = client.get("/v1/jobs", params={"limit": 2, "after": page["last_id"]}).json()
    assert rest["data"][0]["id"] == ids[0]
    # the newest is still queued behind the others: cancelled at once
    assert client.post(f"/v1/jobs/{ids[2]}/cancel").json()["status"] == "cancelled"
    running = client.post(f"/v1/jobs/{ids[0]}/cancel").json()
    assert running["status"] in ("cancelling", "cancelled")
    assert wait_finished(client, ids[0])["status"] == "cancelled"
    assert client.post(f"/v1/jobs/{ids[0]}/cancel").status_code == 409
    assert client.get(f"/v1/jobs/{ids[0]}/output").status_code == 409
    job = client.get(f"/v1/jobs/{ids[1]}").json()
    assert job["progress"]["rows_done"] <= 2005
    if job["status"] not in ("completed",):
        assert client.delete(f"/v1/jobs/{ids[1]}").status_code == 409
    done = wait_finished(client, ids[1])
    assert done["status"] == "completed" and done["progress"]["pairs_per_s"] > 0
    r = client.delete(f"/v1/jobs/{ids[1]}")
    assert r.json() == {"id": ids[1], "object": "job.deleted", "deleted": True}
    assert client.get(f"/v1/jobs/{ids[1]}").status_code == 404
    assert not (server.settings.jobs_dir / ids[1]).exists()
    metrics = httpx.get(server.url + "/metrics").text
    assert 'qtrel_jobs{state="cancelled"}' in metrics and "qtrel_job_pairs_total" in metrics
    assert server.metric("qtrel_job_pairs_total") >= 2005


FORM = {"Content-Type": "multipart/form-data; boundary=b"}


def refused(r: httpx.Response, status: int, words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "error_type"} and words in body["error"], body


def test_refusals(client, server, dirs, tmp_path):
    good = write_input(tmp_path / "good.csv", make_pairs(20)).read_bytes()
    before = client.get("/v1/jobs", params={"limit": 100}).json()["data"]
    post = client.post
    refused(post("/v1/jobs", content=good), 422, "?filename=")
    refused(post("/v1/jobs", content=good, params={"filename": "x.txt"}), 422, "unknown format")
    refused(post("/v1/jobs", content=b"a,b\n1,2\n", params={"filename": "x.csv"}), 422, "no column 'query'")
    refused(post("/v1/jobs", content=b"\xff\xfe\x00garbage", params={"filename": "x.parquet"}), 422, "parquet")
    refused(post("/v1/jobs", content=b"query,title\n", params={"filename": "x.csv"}), 422, "no rows")
    refused(post("/v1/jobs", content=b"query,title\ndrill,\n", params={"filename": "x.csv"}), 422, "skip_bad")
    refused(post("/v1/jobs", content=good, params={"filename": "x.csv", "model": "nope"}), 404, "nope")
    refused(post("/v1/jobs", content=good, params={"filename": "x.csv", "max_chunks": "0"}), 422, "max_chunks")
    refused(post("/v1/jobs", content=good, params={"filename": "x.csv", "colour": "red"}), 422, "colour")
    clash = b"query,title,score\ndrill,DEWALT drill,3\n"
    refused(post("/v1/jobs", content=clash, params={"filename": "x.csv"}), 422, "prefix")
    refused(post("/v1/jobs", files={"other": ("x.csv", good)}), 422, "as `file`")
    refused(post("/v1/jobs", content=b"--b\r\n\r\nx\r\n--b--\r\n", headers=FORM), 422, "no file")
    big = b"query,title\n" + b"drill,DEWALT drill\n" * 120_000  # over 2 MB
    refused(post("/v1/jobs", content=big, params={"filename": "x.csv"}), 413, "job_max_bytes")
    rows = b"query,title\n" + b"a,b\n" * 5001
    refused(post("/v1/jobs", content=rows, params={"filename": "x.csv"}), 413, "job_max_rows")
    outside = write_input(dirs / "other" / "pairs.csv", make_pairs(5))
    refused(post("/v1/jobs", json={"input_path": str(outside)}), 403, "outside")
    sneaky = str(dirs / "allowed" / ".." / "other" / "pairs.csv")
    refused(post("/v1/jobs", json={"input_path": sneaky}), 403, "outside")
    (dirs / "allowed" / "link.csv").symlink_to(outside)
    refused(post("/v1/jobs", json={"input_path": str(dirs / "allowed" / "link.csv")}), 403, "outside")
    refused(post("/v1/jobs", json={"input_path": str(dirs / "allowed" / "none.csv")}), 422, "no such")
    refused(post("/v1/jobs", json={"path": "x"}), 422, "input_path")
    refused(client.get("/v1/jobs/job_nope"), 404, "job_nope")
    for odd in ("job_..", ".incoming", "job_0123456789abcdef0123456789"):  # no folder of ours
        refused(client.get(f"/v1/jobs/{odd}"), 404, "no job")
        refused(client.delete(f"/v1/jobs/{odd}"), 404, "no job")
    refused(client.get("/v1/jobs", params={"after": "job_nope"}), 404, "job_nope")
    assert client.get("/v1/jobs", params={"limit": 100}).json()["data"] == before  # nothing was queued
    assert list((server.settings.jobs_dir / ".incoming").iterdir()) == []  # and no upload left behind


def test_job_that_fails_midway_says_why_and_loses_nothing_else(client, server, tmp_path):
    rows = [json.dumps({"query": "drill", "title": f"DEWALT drill {i}"}) for i in range(30)]
    rows[25] = json.dumps({"query": "drill", "title": "DEWALT", "level": "5"})  # clashes with the score column
    r = client.post("/v1/jobs", content="\n".join(rows).encode(), params={"filename": "x.jsonl", "chunk_rows": "10"})
    assert r.status_code == 200, r.text
    job = wait_finished(client, r.json()["id"])
    assert job["status"] == "failed" and "level" in job["error"]["message"] and job["failed_at"]
    assert str(server.settings.jobs_dir) not in job["error"]["message"]  # the client's file, not our paths
    assert client.get(f"/v1/jobs/{job['id']}/output").status_code == 409
    ok = client.post("/score", json={"query": "drill", "titles": ["DEWALT drill"]})
    assert ok.status_code == 200


def test_too_many_jobs_and_too_little_disk(tiny_checkpoint, tmp_path):
    src = write_input(tmp_path / "p.csv", make_pairs(3000)).read_bytes()
    with live_server(tiny_checkpoint, jobs_dir=tmp_path / "j", job_max_jobs=1, job_min_free_bytes=0) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.post("/v1/jobs", content=src, params={"filename": "p.csv"}).status_code == 200
            refused(c.post("/v1/jobs", content=src, params={"filename": "p.csv"}), 429, "job_max_jobs")
    with live_server(tiny_checkpoint, jobs_dir=tmp_path / "k", job_min_free_bytes=1 << 62) as srv:
        r = httpx.post(srv.url + "/v1/jobs", content=src, params={"filename": "p.csv"})
        refused(r, 507, "job_min_free_bytes")


def test_jobs_off_and_keys(tiny_checkpoint, tmp_path):
    with live_server(tiny_checkpoint) as srv:
        refused(httpx.get(srv.url + "/v1/jobs"), 404, "QTREL_JOBS_DIR")
    src = write_input(tmp_path / "p.csv", make_pairs(10)).read_bytes()
    with live_server(tiny_checkpoint, jobs_dir=tmp_path / "j", api_keys="alice-key,bob-key", job_min_free_bytes=0) as s:
        alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("alice-key", "bob-key"))
        refused(httpx.post(s.url + "/v1/jobs", content=src, params={"filename": "p.csv"}), 401, "API key")
        r = httpx.post(s.url + "/v1/jobs", content=src, params={"filename": "p.csv"}, headers=alice)
        assert r.status_code == 200, r.text
        jid = r.json()["id"]
        assert httpx.get(f"{s.url}/v1/jobs/{jid}", headers=alice).status_code == 200
        refused(httpx.get(f"{s.url}/v1/jobs/{jid}", headers=bob), 404, jid)  # each key sees its own jobs
        assert httpx.get(s.url + "/v1/jobs", headers=bob).json()["data"] == []
