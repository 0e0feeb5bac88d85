"""Several models in one live server, on two real tiny checkpoints that differ (seeds 0 and 1): routing by
name, 404 for a name not served, GET /v1/models, Cohere's SDK reaching the second model, and reloads
(admin route, under load, a broken checkpoint, in place) that fail no request."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.service.conftest import live_server

QUERY = "cordless drill"
TITLES = ["DEWALT 20V MAX Cordless Drill", "Garden hose 50 ft", "drill bits set", "ladder"]
ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny2") / "tiny-bert-2", seed=1)


@pytest.fixture(scope="module")
def two(tiny_checkpoint, second_checkpoint):
    models = f"a={tiny_checkpoint},b={second_checkpoint}"
    with live_server(tiny_checkpoint, models=models, max_wait_ms=2, admin_keys=ADMIN) as srv:
        yield srv


def scores(srv, model=None, **extra) -> list[float]:
    body = {"query": QUERY, "titles": TITLES, **({"model": model} if model else {}), **extra}
    r = httpx.post(srv.url + "/score", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return [x["score"] for x in r.json()["results"]]


def reload(srv, name, path=None, key=ADMIN) -> httpx.Response:
    body = {"path": str(path)} if path else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{srv.url}/admin/models/{name}/reload", json=body, headers=headers, timeout=120)


def test_both_models_answer_by_name_and_differ(two):
    r = httpx.post(two.url + "/score", json={"query": QUERY, "titles": TITLES, "model": "b"})
    assert r.status_code == 200 and r.json()["model"] == "b"
    a, b = scores(two, "a"), scores(two, "b")
    assert a != b
    assert scores(two) == a  # no name: the default, the first
    tok = httpx.post(two.url + "/tokenize", json={"query": QUERY, "title": TITLES[0], "model": "b"}).json()
    assert tok["model"] == "b"
    cohere = httpx.post(two.url + "/v2/rerank", json={"model": "b", "query": QUERY, "documents": TITLES}).json()
    assert cohere["model"] == "b"
    assert httpx.post(two.url + "/rerank", json={"query": QUERY, "texts": TITLES}).status_code == 200  # TEI: default
    explained = httpx.post(
        two.url + "/explain", json={"query": QUERY, "title": TITLES[0], "model": "b", "top_heads": 1}
    )
    assert explained.status_code == 200 and explained.json()["model"] == "b"


def test_a_name_not_served_is_404_listing_the_served(two):
    for path, body in (
        ("/score", {"query": QUERY, "titles": TITLES, "model": "c"}),
        ("/tokenize", {"query": QUERY, "title": "t", "model": "c"}),
        ("/v1/rerank", {"model": "rerank-v3.5", "query": QUERY, "documents": TITLES}),
    ):
        r = httpx.post(two.url + path, json=body)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error_type"] == "model_not_found" and "served: a, b" in r.json()["error"]
    r = httpx.post(two.url + "/score", json={"query": QUERY, "titles": TITLES, "model": 3})
    assert r.status_code == 422  # not a name


def test_v1_models_lists_each_with_its_state_generation_and_share(two):
    listed = httpx.get(two.url + "/v1/models").json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["a", "b"]
    for m in listed["data"]:
        assert m["state"] == "ready" and m["levels"] == ["1", "2", "3", "4", "5"] and m["generation"] >= 1
        assert m["dtype"] == "float32" and m["device"] == "cpu" and m["layout"]["replicas"] >= 1
    assert [m["default"] for m in listed["data"]] == [True, False]
    info = httpx.get(two.url + "/info").json()
    assert [m["id"] for m in info["models"]] == ["a", "b"] and info["model_id"] == "a"


def test_cohere_sdk_reaches_the_second_model_by_name(two):
    cohere = pytest.importorskip("cohere", reason="the cohere SDK is not installed (pip install cohere)")
    client = cohere.ClientV2(api_key="x", base_url=two.url)
    by_name = {
        name: {x.index: x.relevance_score for x in client.rerank(model=name, query=QUERY, documents=TITLES).results}
        for name in ("a", "b")
    }
    assert by_name["a"] != by_name["b"]
    direct = scores(two, "b")  # the same order as /score's for that model
    assert sorted(by_name["b"], key=lambda i: -by_name["b"][i]) == sorted(range(len(TITLES)), key=lambda i: -direct[i])


def test_the_admin_route_takes_the_admin_key_only(two):
    assert reload(two, "a", key=None).status_code == 401
    assert reload(two, "a", key="wrong").status_code == 401
    assert reload(two, "nope").status_code == 404
    r = httpx.post(f"{two.url}/admin/models/a/reload", json={"path": 3}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 422 and r.json()["error_type"] == "validation"


def test_a_reload_switches_to_the_new_checkpoint_and_never_serves_old_scores(two, tiny_checkpoint, second_checkpoint):
    before_a, before_b = scores(two, "a"), scores(two, "b")  # cached now
    gen = next(m["generation"] for m in httpx.get(two.url + "/v1/models").json()["data"] if m["id"] == "a")
    r = reload(two, "a", second_checkpoint)  # a now serves b's weights
    assert r.status_code == 200, r.text
    assert r.json()["generation"] == gen + 1 and r.json()["path"] == str(second_checkpoint)
    assert r.json()["last_reload"]["ok"] and r.json()["last_reload"]["mode"] == "beside"
    assert scores(two, "a") == pytest.approx(before_b)  # not the cached scores of the old weights
    assert reload(two, "a", tiny_checkpoint).status_code == 200  # and back
    assert scores(two, "a") == pytest.approx(before_a)
    assert two.metric("qtrel_model_reloads_total", model="a", result="ok") >= 2
    assert two.metric("qtrel_model_generation", model="a") == gen + 2


def test_a_broken_checkpoint_leaves_the_old_model_serving(two, tmp_path):
    before = scores(two, "b")
    failed = two.metric("qtrel_model_reloads_total", model="b", result="failed")
    (tmp_path / "config.json").write_text("{not json")
    for path in (tmp_path, tmp_path / "missing"):
        r = reload(two, "b", path)
        assert r.status_code == 422 and r.json()["error_type"] == "reload_failed", r.text
        assert str(path) in r.json()["error"]
    assert scores(two, "b", return_probs=False) == before
    assert two.metric("qtrel_model_reloads_total", model="b", result="failed") == failed + 2
    card = next(m for m in httpx.get(two.url + "/v1/models").json()["data"] if m["id"] == "b")
    assert card["state"] == "ready" and card["last_reload"]["ok"] is False


def hammer(url: str, stop: threading.Event, statuses: list[int], model: str | None) -> None:
    """Score distinct pairs in a loop (no cache hits), recording every status."""
    with httpx.Client(timeout=60) as client:
        i = 0
        while not stop.is_set():
            i += 1
            body = {"query": f"drill {i}", "titles": [f"{t} {i}" for t in TITLES], "model": model}
            try:
                statuses.append(client.post(url + "/score", json=body).status_code)
            except httpx.TransportError:
                statuses.append(0)


@pytest.mark.parametrize("mode", ["beside", "in_place"])
def test_reloads_under_load_fail_no_request(tiny_checkpoint, second_checkpoint, mode):
    models = f"a={tiny_checkpoint},b={second_checkpoint}"
    with live_server(
        tiny_checkpoint, models=models, reload=mode, worker="thread", warmup=False, admin_keys=ADMIN
    ) as srv:
        stop, statuses = threading.Event(), []
        threads = [threading.Thread(target=hammer, args=(srv.url, stop, statuses, m)) for m in ("a", "a", "b")]
        for t in threads:
            t.start()
        try:
            for _ in range(3):
                time.sleep(0.3)
                r = reload(srv, "a")
                assert r.status_code == 200 and r.json()["last_reload"]["mode"] == mode, r.text
        finally:
            time.sleep(0.3)
            stop.set()
            for t in threads:
                t.join()
        assert len(statuses) > 20 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
        assert srv.metric("qtrel_model_generation", model="a") == 4


def test_one_model_takes_any_name_as_before(server):
    r = httpx.post(server.url + "/score", json={"query": QUERY, "titles": TITLES, "model": "whatever"})
    assert r.status_code == 200 and r.json()["model"] == "tiny-bert"
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["tiny-bert"]


def test_admin_keys_and_api_keys_do_not_stand_in_for_each_other(tiny_checkpoint):
    with live_server(tiny_checkpoint, worker="thread", warmup=False, api_keys="user-key", admin_keys=ADMIN) as srv:
        name = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer user-key"}).json()["data"][0]["id"]
        assert reload(srv, name, key="user-key").status_code == 401
        assert reload(srv, name).status_code == 200
        denied = httpx.post(
            srv.url + "/score", json={"query": QUERY, "titles": TITLES}, headers={"Authorization": f"Bearer {ADMIN}"}
        )
        assert denied.status_code == 401
        assert httpx.get(srv.url + "/v1/models").status_code == 401


def test_the_admin_route_is_off_where_no_key_guards_it(tiny_checkpoint):
    with live_server(tiny_checkpoint, worker="thread", warmup=False) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        r = reload(srv, name, key=None)
        assert r.status_code == 403 and r.json()["error_type"] == "forbidden"
        assert "QTREL_ADMIN_KEYS" in r.json()["error"]
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["generation"] == 1  # nothing reloaded


def test_a_second_reload_of_the_same_model_meanwhile_is_409(tiny_checkpoint):
    with live_server(tiny_checkpoint, worker="thread", admin_keys=ADMIN) as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
        results: list[httpx.Response] = []
        calls = [threading.Thread(target=lambda: results.append(reload(srv, name))) for _ in range(2)]
        for t in calls:
            t.start()
        for t in calls:
            t.join()
        assert sorted(r.status_code for r in results) == [200, 409]
        busy = next(r for r in results if r.status_code == 409).json()
        assert busy["error_type"] == "conflict" and "already being reloaded" in busy["error"]
