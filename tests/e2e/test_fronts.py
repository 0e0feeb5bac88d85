"""`qtrel serve --http-workers 2` as real processes: two front processes on one port feeding one engine
core. One server (two models, a shadow, API and admin keys) is shared by the route tests; drain, the crash
loop and the core's death each end a server of their own."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.e2e.test_sigterm import gone, wait_ready
from tests.service.conftest import free_port

pytestmark = pytest.mark.slow
KEY, KEY2, ADMIN = "key-one-0123456789", "key-two-0123456789", "admin-0123456789"
BODY = {"query": "cordless drill", "titles": ["dewalt 20v max cordless drill", "garden hose 50 ft"]}


def serve(model_args: list[str], port: int, log, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "service.cli", "serve", *model_args, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--http-workers", "2", "--no-warmup", "--inference", "torch", *extra]
    environ = {**os.environ, "QTREL_LOG_JSON": "true", **(env or {})}
    return subprocess.Popen(cmd, env=environ, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, keys):
        self.proc, self.url, self.keys = proc, f"http://127.0.0.1:{port}", keys

    def post(self, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers | kw.pop("headers", {}), timeout=30, **kw)

    def get(self, path: str, key: str | None = KEY) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)

    def fronts(self) -> dict:
        return self.get("/info").json()["fronts"]

    def metric(self, line_start: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fronts")
    second = make_tiny_checkpoint(tmp / "second", seed=1)
    shadow = make_tiny_checkpoint(tmp / "shadow", seed=2)
    keys = tmp / "keys.txt"
    keys.write_text(KEY + "\n")
    port = free_port()
    models = ["--model", f"a={tiny_checkpoint}", "--model", f"b={second}"]
    extra = ["--shadow", f"s={shadow}", "--shadow-rate", "1", "--api-keys-file", str(keys), "--admin-keys", ADMIN]
    with open(tmp / "server.log", "w") as log:
        proc = serve(models, port, log, *extra)
    srv = Server(proc, port, keys)
    try:
        wait_ready(srv.url, proc, timeout=180)
        yield srv
    finally:
        proc.terminate()
        proc.wait(90)


def test_info_shows_two_fronts_and_every_route_answers(server):
    f = server.fronts()
    assert f["http_workers"] == 2 and len(f["pids"]) == 2 and f["chosen"] == "set"
    a = server.post("/score", BODY | {"model": "a", "return_probs": True})
    b = server.post("/score", BODY | {"model": "b"})
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    assert a.json()["model"] == "a" and len(a.json()["results"][0]["probs"]) == 5
    assert [r["score"] for r in a.json()["results"]] != [r["score"] for r in b.json()["results"]]
    pred = server.post("/predict", {"inputs": [["drill", "cordless drill"], ["drill", "hose"]]})
    assert pred.status_code == 200 and len(pred.json()) == 2
    rr = server.post("/rerank", {"query": "drill", "texts": ["hose", "cordless drill"], "return_text": True})
    assert rr.status_code == 200 and {r["text"] for r in rr.json()} == {"hose", "cordless drill"}
    for path in ("/v1/rerank", "/v2/rerank"):
        r = server.post(path, {"model": "a", "query": "drill", "documents": ["hose", "drill"], "top_n": 1})
        assert r.status_code == 200 and len(r.json()["results"]) == 1, r.text
    tok = server.post("/tokenize", {"query": "drill", "title": "cordless drill", "model": "b"})
    assert tok.status_code == 200 and tok.json()["results"][0]["input_ids"][0] == 101
    ex = server.post("/explain", {"query": "drill", "title": "cordless drill"})
    assert ex.status_code == 200 and ex.json()["model"] == "a", ex.text
    long = " ".join(["cordless drill with two batteries and a charger"] * 35)
    w = server.post("/score", {"query": "drill", "titles": [long], "max_chunks": 8})
    assert w.status_code == 200 and w.json()["results"][0]["window"]["count"] > 1, w.text
    listing = server.get("/v1/models").json()["data"]
    assert [m["id"] for m in listing] == ["a", "b"]
    assert server.get("/health/live", key=None).status_code == 200
    assert server.get("/health/ready", key=None).status_code == 200
    assert server.post("/score", {"query": "drill"}).status_code == 422
    assert server.post("/score", BODY | {"model": "nope"}).status_code == 404
    assert server.post("/score", {"query": "x" * 5000, "titles": ["y"]}).status_code == 413


def test_the_cache_and_metrics_are_one_across_fronts(server):
    hits0 = server.metric("qtrel_cache_hits_total")
    scored0 = server.metric('qtrel_requests_total{route="/score",status="200"}')
    body = {"query": "unique query for the cache", "titles": ["one title only"], "model": "a"}
    assert server.post("/score", body).status_code == 200  # scored once: cached in the core

    async def many():  # 24 connections at once: both fronts take some
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
            return await asyncio.gather(*(client.post(server.url + "/score", json=body) for _ in range(24)))

    assert [r.status_code for r in asyncio.run(many())] == [200] * 24
    assert server.metric("qtrel_cache_hits_total") - hits0 == 24  # not 24 - 1 per front
    assert server.metric('qtrel_requests_total{route="/score",status="200"}') - scored0 == 25
    text = server.get("/metrics").text
    assert 'qtrel_request_duration_seconds_count{route="/score"}' in text and "qtrel_queue_depth" in text
    shadowed = [float(x.split()[-1]) for x in text.splitlines() if x.startswith("qtrel_shadow_pairs_total{")]
    assert sum(shadowed) > 0  # the core hands the default model's pairs to the shadow (rate 1)
    assert server.metric('qtrel_pairs_total{model="a"}') >= 25


def test_keys_are_required_and_rotate_on_sighup(server):
    assert server.post("/score", BODY, key=None).status_code == 401
    assert server.post("/score", BODY, key="wrong").status_code == 401
    server.keys.write_text(KEY2 + "\n" + KEY + "\n")
    server.proc.send_signal(signal.SIGHUP)  # also reloads every model: the generations move
    for _ in range(8):  # fresh connections: both fronts read the new file
        assert server.post("/score", BODY, key=KEY2).status_code == 200
    server.keys.write_text(KEY + "\n")
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while server.post("/score", BODY, key=KEY2).status_code != 401:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_reload_by_the_admin_route_moves_every_front_to_the_new_generation(server):
    gen = {m["id"]: m["generation"] for m in server.get("/v1/models").json()["data"]}
    assert server.post("/admin/models/b/reload", None, key=KEY).status_code == 401
    deadline = time.monotonic() + 60
    while (r := server.post("/admin/models/b/reload", None, key=ADMIN)).status_code == 409:  # a SIGHUP's reload
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert r.status_code == 200 and r.json()["generation"] > gen["b"], r.text
    for _ in range(8):  # each front tokenises for the new generation at once
        assert server.post("/score", BODY | {"model": "b"}).status_code == 200
    assert server.metric('qtrel_model_reloads_total{model="b",result="ok"}') >= 1


def cumulative(server: Server) -> dict[str, float]:
    """Every counter and histogram series of the merged /metrics, by series."""
    lines = server.get("/metrics").text.splitlines()
    kinds = {line.split()[2]: line.split()[3] for line in lines if line.startswith("# TYPE ")}
    out = {}
    for line in lines:
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            base = series.partition("{")[0]
            family = base if base in kinds else base.rpartition("_")[0]  # x_bucket, x_count, x_sum: x
            if kinds.get(family) in ("counter", "histogram"):
                out[series] = float(value)
    return out


def test_a_killed_front_is_replaced_while_the_other_serves_and_no_counter_goes_back(server):
    for _ in range(12):  # a new connection each: both fronts count some
        assert server.post("/score", BODY).status_code == 200
    before = server.fronts()
    last = cumulative(server)  # collected from both fronts
    os.kill(before["pids"][0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    served = 0
    while True:
        try:
            served += server.post("/score", BODY).status_code == 200
        except httpx.TransportError:
            pass  # a connection the dead front had accepted
        now = cumulative(server)
        assert not [s for s, v in last.items() if now.get(s, 0.0) < v], "a merged counter went backwards"
        last = now
        f = server.fronts()
        if f["restarts"] > before["restarts"] and len(f["pids"]) == 2 and served >= 5:
            break
        assert time.monotonic() < deadline, f
        time.sleep(0.1)
    assert before["pids"][0] not in f["pids"] and before["pids"][1] in f["pids"]
    assert server.get("/health/live", key=None).status_code == 200


def descendants(pid: int) -> set[int]:
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        out.update(kids)
        todo += kids
    return out


def test_a_full_server_is_refused_at_every_front_before_the_body_is_read(tiny_checkpoint, tmp_path):
    """The core tells the fronts when every queue is full: a front answers 429 with Retry-After without
    reading the body (not JSON at all here: parsed, it would be a 400), and serves again once there is room."""
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        # A batch waits up to 1.5 s to fill, so 4 admitted pairs hold the queue (max_queue_pairs=4) full.
        extra = ("--max-queue-pairs", "4", "--max-pairs-per-request", "4", "--max-wait-ms", "1500")
        proc = serve(["--model", str(tiny_checkpoint)], port, log, *extra, "--max-batch-size", "64")
    srv = Server(proc, port, None)
    try:
        wait_ready(srv.url, proc, timeout=120)

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"query": "q", "titles": ["t1", "t2", "t3", "t4"]}
                held = asyncio.create_task(client.post(srv.url + "/score", json=body))
                await asyncio.sleep(0.5)
                refused = []
                for _ in range(6):  # a connection each: both fronts answer some (SO_REUSEPORT)
                    async with httpx.AsyncClient(timeout=10) as one:
                        bad = b"{not json"
                        headers = {"content-type": "application/json"}
                        refused.append(await one.post(srv.url + "/v1/rerank", content=bad, headers=headers))
                return await held, refused

        held, refused = asyncio.run(main())
        assert held.status_code == 200
        assert [r.status_code for r in refused] == [429] * 6
        assert all(r.json()["error_type"] == "overloaded" and int(r.headers["retry-after"]) >= 1 for r in refused)
        assert srv.metric('qtrel_rejected_total{reason="overloaded"}') == 6  # counted where refused, summed
        assert srv.post("/score", {"query": "q", "titles": ["t"]}, key=None).status_code == 200
    finally:
        proc.terminate()
        proc.wait(60)


def test_a_request_the_core_would_refuse_is_refused_at_the_front_before_it_is_tokenised(tiny_checkpoint, tmp_path):
    """The core tells the fronts the smallest request its admission refuses now ("admit"): a bigger one is
    answered 429 at the front before it is tokenised (unreadable titles, which tokenised are a 422 there),
    with the core's own body and Retry-After, while a smaller one is still tokenised and admitted."""
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        # A batch waits up to 1.5 s to fill, so 4 admitted pairs hold half the queue (max_queue_pairs=8).
        extra = ("--max-queue-pairs", "8", "--max-pairs-per-request", "8", "--max-wait-ms", "1500", "--cache-mb", "0")
        extra += ("--unknown-share-refuse", "0.3", "--max-batch-size", "64")
        proc = serve(["--model", str(tiny_checkpoint)], port, log, *extra)
    srv = Server(proc, port, None)
    unread = [f"离婚{i}" for i in range(8)]  # every piece [UNK]

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            held = asyncio.create_task(client.post(srv.url + "/score", json={"query": "q", "titles": list("abcd")}))
            await asyncio.sleep(0.5)
            out = []
            for body in (
                {"query": "离婚申请", "titles": unread[:5]},  # 4 + 5 > 8: refused before tokenising
                {"query": "q", "titles": [f"t{i}" for i in range(8)]},  # refused, readable: the same answer
                {"query": "离婚申请", "titles": unread[:4]},  # 4 + 4 fit: tokenised, unreadable
                {"query": "q", "titles": ["e", "f", "g", "h"]},  # admitted: fills the queue
            ):
                async with httpx.AsyncClient(timeout=10) as one:  # a connection each: both fronts answer
                    out.append(await one.post(srv.url + "/score", json=body))
            return await held, out

    try:
        wait_ready(srv.url, proc, timeout=120)
        refused0 = srv.metric('qtrel_rejected_total{reason="overloaded"}')
        held, (big, big_readable, small_unread, small) = asyncio.run(main())
        assert held.status_code == 200 and small.status_code == 200
        assert big.status_code == 429 and big_readable.status_code == 429, big.text
        assert big.json() == big_readable.json() and big.json()["error_type"] == "overloaded"
        assert big.headers["retry-after"] == big_readable.headers["retry-after"]
        assert small_unread.status_code == 422
        assert srv.metric('qtrel_rejected_total{reason="overloaded"}') == refused0 + 2
    finally:
        proc.terminate()
        proc.wait(60)


def test_sigterm_drains_every_front_and_loses_nothing(tiny_checkpoint, tmp_path):
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        extra = ("--max-batch-size", "1", "--drain-timeout-s", "60", "--request-timeout-ms", "120000")
        # admission by expected wait is off: this test queues more than a second of work on purpose
        env = {"QTREL_MAX_QUEUE_WAIT_MS": "0"}
        proc = serve(["--model", str(tiny_checkpoint)], port, log, *extra, env=env)
    srv = Server(proc, port, None)
    try:
        wait_ready(srv.url, proc, timeout=120)
        kids = descendants(proc.pid)
        titles = [f"cordless drill number {i}" for i in range(10)]

        async def main():
            async with httpx.AsyncClient(timeout=90) as client:
                tasks = [
                    asyncio.create_task(client.post(srv.url + "/score", json={"query": f"q{i}", "titles": titles}))
                    for i in range(30)
                ]
                for _ in range(100):  # until most of the work is queued in the core
                    await asyncio.sleep(0.05)
                    if srv.metric("qtrel_pairs_in_flight") >= 150:
                        break
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        statuses = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in results]
        assert statuses == [200] * 30, statuses
        assert proc.wait(timeout=90) == 0
        assert all(gone(k, 10) for k in kids)  # fronts and model processes: no orphans
        with pytest.raises(httpx.TransportError):  # nothing accepted after the exit, to be dropped
            httpx.get(srv.url + "/health/ready", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_front_crash_loop_fails_liveness_and_the_core_s_death_ends_the_fronts(tiny_checkpoint, tmp_path):
    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        proc = serve(["--model", str(tiny_checkpoint)], port, log)
    srv = Server(proc, port, None)
    try:
        wait_ready(srv.url, proc, timeout=120)
        killed: set[int] = set()
        deadline = time.monotonic() + 120
        while True:  # kill every front as soon as it is up, until liveness reports the crash loop
            try:
                live = httpx.get(srv.url + "/health/live", timeout=5)
                if live.status_code == 503:
                    assert "crash loop" in live.json()["error"], live.text
                    break
                for pid in set(srv.fronts()["pids"]) - killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert len(killed) >= 6
        fronts = set(srv.fronts()["pids"])
        assert fronts
        proc.kill()  # the core dies: its fronts end, and nothing answers on the port
        assert all(gone(p, 15) for p in fronts)
        with pytest.raises(httpx.TransportError):
            httpx.get(srv.url + "/health/live", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_a_checkpoint_that_cannot_load_ends_the_core_and_its_fronts_with_the_reason(tiny_checkpoint, tmp_path):
    model = tmp_path / "truncated"
    shutil.copytree(tiny_checkpoint, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = serve(["--model", str(model)], free_port(), subprocess.PIPE)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    last = out.decode().strip().splitlines()[-1]
    assert last.startswith("qtrel serve: model failed to load") and "cannot read weights" in last, last
