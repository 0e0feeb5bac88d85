"""A model that cannot read a text says so: the English default on a Chinese pair reports its unknown-token
share (counted from the ids the engine's own encode made, kept in the pair cache) on /score, TEI /rerank and
Cohere's routes, and warns; a setting refuses such pairs with a 422; /v1/models names the languages each
model reads. The same with two front processes, which count it where they tokenise."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from model.builtin import builtin_dir
from tests.service.conftest import free_port, live_server

CHINESE = {"query": "离婚申请", "titles": ["苹果手机价格"]}  # divorce application / iPhone prices
UNREAD = {"query": "离婚申请", "titles": ["离婚"]}  # every piece [UNK]
ENGLISH = {"query": "cordless drill", "titles": ["DEWALT 20V MAX Cordless Drill"]}


@pytest.fixture(scope="module")
def default():
    with live_server(builtin_dir("default"), max_wait_ms=2) as srv:
        yield srv


def test_english_default_reports_a_chinese_pair_unreadable_and_warns(default):
    r = httpx.post(default.url + "/score", json=CHINESE, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    (res,) = body["results"]
    assert res["unknown_share"] == pytest.approx(0.9)  # 9 of its 10 word pieces are [UNK]; 手 is known
    (warning,) = body["warnings"]
    assert "[0]" in warning and "unknown" in warning


def test_a_readable_pair_reports_no_unknown_share_and_no_warning(default):
    body = httpx.post(default.url + "/score", json=ENGLISH, timeout=30).json()
    assert body["results"][0]["unknown_share"] == 0.0
    assert "warnings" not in body


def test_models_name_their_languages(default):
    (card,) = httpx.get(default.url + "/v1/models", timeout=30).json()["data"]
    assert card["languages"] == ["en"]


def test_a_setting_refuses_unreadable_pairs_with_422():
    with live_server(builtin_dir("default"), max_wait_ms=2, unknown_share_refuse=0.3) as srv:
        r = httpx.post(srv.url + "/score", json=CHINESE, timeout=30)
        assert r.status_code == 422
        assert "pair 0: 90% of its tokens are unknown" in r.text
        r = httpx.post(srv.url + "/v2/rerank", json={"query": CHINESE["query"], "documents": CHINESE["titles"]})
        assert r.status_code == 422
        assert httpx.post(srv.url + "/score", json=ENGLISH, timeout=30).status_code == 200


def test_rerank_routes_show_the_share_and_a_cache_hit_keeps_it(default):
    hits = default.metric("qtrel_cache_hits_total")
    tei = httpx.post(default.url + "/rerank", json={"query": CHINESE["query"], "texts": CHINESE["titles"]})
    assert tei.status_code == 200 and tei.json()[0]["unknown_share"] == pytest.approx(0.9)
    assert "unknown" in tei.headers["X-Qtrel-Warning"]
    for v in ("v1", "v2"):
        co = httpx.post(default.url + f"/{v}/rerank", json={"query": CHINESE["query"], "documents": CHINESE["titles"]})
        assert co.json()["results"][0]["unknown_share"] == pytest.approx(0.9)
        assert "unknown" in co.json()["meta"]["warnings"][0]
    assert default.metric("qtrel_cache_hits_total") >= hits + 2  # the pair came from the cache, share and all
    en = httpx.post(default.url + "/rerank", json={"query": ENGLISH["query"], "texts": ENGLISH["titles"]})
    assert en.json()[0]["unknown_share"] == 0.0 and "X-Qtrel-Warning" not in en.headers


def test_a_refused_pair_is_refused_from_the_cache_too():
    with live_server(builtin_dir("default"), max_wait_ms=2, unknown_share_refuse=0.95) as srv:
        for _ in range(2):  # the second time the 0.9 pair is a cache hit: still served, still warned
            r = httpx.post(srv.url + "/score", json=CHINESE, timeout=30)
            assert r.status_code == 200 and r.json()["results"][0]["unknown_share"] == pytest.approx(0.9)
        scored = srv.metric("qtrel_pairs_total")
        r = httpx.post(srv.url + "/score", json={"query": UNREAD["query"], "titles": [*ENGLISH["titles"], "离婚"]})
        assert r.status_code == 422 and "pair 1: 100% of its tokens are unknown" in r.text
        assert srv.metric("qtrel_pairs_total") == scored  # nothing of the refused request was scored


@pytest.mark.slow
def test_two_fronts_count_it_where_they_tokenise(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", "builtin:default", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--http-workers", "2", "--no-warmup", "--inference", "torch"]
    env = {**os.environ, "QTREL_UNKNOWN_SHARE_REFUSE": "0.95"}
    with open(tmp_path / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        for _ in range(2):  # the second answer is the core's cache hit
            body = httpx.post(url + "/score", json=CHINESE, timeout=30).json()
            assert body["results"][0]["unknown_share"] == pytest.approx(0.9) and body["warnings"]
        co = httpx.post(url + "/v2/rerank", json={"query": CHINESE["query"], "documents": CHINESE["titles"]}).json()
        assert co["results"][0]["unknown_share"] == pytest.approx(0.9)
        r = httpx.post(url + "/score", json=UNREAD, timeout=30)
        assert r.status_code == 422 and "100% of its tokens are unknown" in r.text
    finally:
        proc.terminate()
        proc.wait(90)
