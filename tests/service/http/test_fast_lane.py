"""The scoring routes' fast lane (service.http.fast): a plainly valid scoring request is served past FastAPI's
per-request machinery, anything else goes FastAPI's way, and a client cannot tell which: every request
below is sent to two real servers on the tiny checkpoint, one with the lane and one without, and must get
the same status, body and headers; the lane's count says which requests it took."""

from __future__ import annotations

import asyncio
from typing import Annotated

import httpx
import pytest
from fastapi import Depends, FastAPI, Request

from service.app import create_app
from service.http import deps
from service.http.fast import Declared, LaneMismatch, routes_of
from service.http.routes import predict, score
from service.http.schemas import PredictRequest, ScoreRequest
from service.settings import Settings
from tests.service.conftest import LiveServer, free_port, live_server

KEY = "lane-key-0123456789"
LONG_TITLE = " ".join(["cordless drill with battery and charger kit"] * 40)
JSON = {"content-type": "application/json"}


def nested(depth: int) -> list:
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


def case(path, body=None, headers=None, raw=None, taken=True):
    return pytest.param(path, body, headers or {}, raw, taken, id=f"{path}-{len(CASES)}")


CASES: list = []
for c in [
    # valid: the lane serves them
    ("/score", {"query": "cordless drill", "titles": ["DEWALT 20V drill", "garden hose"]}),
    ("/score", {"pairs": [{"query": "drill", "title": "hammer"}], "return_probs": False, "top_n": 1}),
    ("/score", {"query": "drill", "titles": [LONG_TITLE], "max_chunks": 3}),
    ("/score", {"query": "drill", "titles": [LONG_TITLE], "truncation": "only_second"}),
    ("/score", {"query": "drill", "titles": ["hammer"]}, {"cache-control": "no-cache"}),
    ("/score", {"query": "drill", "titles": ["hammer"]}, {"x-request-timeout-ms": "30000"}),
    ("/score", {"query": "drill", "titles": ["hammer"]}, {"content-type": "application/json; charset=utf-8"}),
    ("/predict", {"inputs": ["cordless drill", "DEWALT drill"]}),
    ("/predict", {"inputs": [["drill", "hammer"], ["saw", "circular saw"]], "raw_scores": True}),
    ("/rerank", {"query": "drill", "texts": ["cordless drill", "hammer"], "return_text": True}),
    ("/v1/rerank", {"query": "drill", "documents": ["cordless drill", "hammer"], "top_n": 1}),
    ("/v2/rerank", {"query": "drill", "documents": [{"text": "cordless drill"}, "hammer"], "model": "qtrel"}),
    # valid bodies the endpoint refuses: the lane answers with the one error map
    ("/score", {"query": "drill", "titles": ["x" * 20_000]}),
    ("/score", {"query": "drill", "titles": ["hammer"], "model": "no-such-model"}),
    ("/predict", {"inputs": ["drill", LONG_TITLE], "truncate": False}),
    ("/rerank", {"query": "drill", "texts": ["hammer"], "x": nested(20)}),  # an unknown field, ignored
]:
    CASES.append(case(*c))
for c in [
    # left to FastAPI: what it refuses or reads its own way
    ("/score", None, {}, b'{"query": "drill", "titles": ["hammer"]}'),  # no content type
    ("/score", None, {"content-type": "text/plain"}, b'{"query": "drill", "titles": ["hammer"]}'),
    ("/score", None, JSON, b'{"query": "drill", "titles": ['),
    ("/score", None, JSON, b""),
    ("/score", None, JSON, b"[1, 2]"),
    ("/score", {"query": "drill", "titles": 5}),
    ("/score", {"query": "drill"}),
    ("/v2/rerank", {"query": "drill", "documents": []}),
    ("/score", {"query": "drill", "titles": ["hammer"]}, {"x-request-timeout-ms": "0"}),
    ("/score", {"query": "drill", "titles": ["hammer"]}, {"x-request-timeout-ms": "soon"}),
    ("/score", {"query": "drill", "titles": ["hammer"]}, {"x-request-timeout-ms": "5.0"}),  # FastAPI takes it
    ("/score", {"query": "drill", "titles": ["hammer"]}, [("cache-control", "no-cache"), ("cache-control", "x")]),
    ("/score", {"query": "drill", "titles": ["hammer"]}, {"x-request-timeout-ms": "0" * 4300 + "30000"}),
    ("/rerank", None, JSON, b'{"query": "drill", "texts": ["hammer"], "x": ' + b"[" * 970 + b"]" * 970 + b"}"),
    ("/predict", {"inputs": [["drill", "hammer"]] * 901}),  # over MAX_BRACKETS: decoded FastAPI's way
]:
    path, body, headers, raw = c + (None,) * (4 - len(c))
    CASES.append(case(path, body, headers, raw, taken=False))


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=1, replicas=1) as on:
        with live_server(tiny_checkpoint, max_wait_ms=1, replicas=1, fast_lane=False) as off:
            assert on.app.state.fast_lane is not None and off.app.state.fast_lane is None
            yield on, off


def send(url: str, path: str, body, headers, raw) -> httpx.Response:
    if raw is not None:
        return httpx.post(url + path, content=raw, headers=headers, timeout=30)
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def same(a: httpx.Response, b: httpx.Response) -> None:
    assert a.status_code == b.status_code, (a.text, b.text)
    ja, jb = a.json(), b.json()
    if isinstance(ja, dict) and "results" in ja:  # Cohere's answers carry a fresh id each
        ja.pop("id", None), jb.pop("id", None)
    assert ja == jb
    for h in ("content-type", "retry-after", "www-authenticate"):
        assert a.headers.get(h) == b.headers.get(h), h


@pytest.mark.parametrize(("path", "body", "headers", "raw", "taken"), CASES)
def test_with_the_lane_or_without_a_client_gets_the_same_answer(pair, path, body, headers, raw, taken):
    on, off = pair
    lane = on.app.state.fast_lane
    before = lane.served
    a = send(on.url, path, body, headers, raw)
    b = send(off.url, path, body, headers, raw)
    same(a, b)
    assert lane.served - before == int(taken)
    if taken and a.status_code == 200:
        assert a.headers["x-request-id"]  # the edge middleware still wraps what the lane serves


def test_the_lane_counts_requests_in_the_metrics_like_fastapi(pair):
    on, _ = pair
    before = on.metric("qtrel_requests_total", route="/score", status="200")
    for _ in range(3):
        assert send(on.url, "/score", {"query": "saw", "titles": ["saw"]}, {}, None).status_code == 200
    assert on.metric("qtrel_requests_total", route="/score", status="200") - before == 3


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=1, replicas=1, api_keys=KEY) as on:
        with live_server(tiny_checkpoint, max_wait_ms=1, replicas=1, api_keys=KEY, fast_lane=False) as off:
            yield on, off


@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}", f"bearer {KEY}", "Bearer", "Bearer ключ".encode()]
)
def test_the_lane_asks_for_the_api_key_as_fastapi_does(keyed, auth):
    on, off = keyed
    headers = {} if auth is None else {"authorization": auth}
    body = {"query": "drill", "titles": ["cordless drill"]}
    before = on.app.state.fast_lane.served
    same(send(on.url, "/score", body, headers, None), send(off.url, "/score", body, headers, None))
    assert on.app.state.fast_lane.served - before == 1  # refused by the lane itself, with the key's 401
    ok = on.metric("qtrel_requests_by_key_total")
    assert ok == off.metric("qtrel_requests_by_key_total")


def test_the_five_scoring_routes_are_in_the_lane_and_nothing_else():
    assert set(routes_of(create_app(Settings()))) == {"/score", "/predict", "/rerank", "/v1/rerank", "/v2/rerank"}
    keyed = routes_of(create_app(Settings(api_keys=KEY)))
    assert all(r.keyed for r in keyed.values()) and len(keyed) == 5


async def other_dependency() -> None:
    pass


def test_only_declared_routes_are_in_the_lane_and_a_mismatch_stops_the_app():
    """The lane's routes are declared (fast.LANE), never inferred: a route of the right shape that is not
    declared stays FastAPI's; a declared route that FastAPI serves otherwise refuses to build the lane."""

    async def one_more(
        body: ScoreRequest,
        request: Request,
        engine: deps.EngineDep,
        settings: deps.SettingsDep,
        metrics: deps.MetricsDep,
        use_cache: deps.UseCacheDep,
        extra: Annotated[None, Depends(other_dependency)],
        timeout_ms: deps.TimeoutHeader = None,
    ): ...

    app = FastAPI()
    app.post("/exact")(score)  # the real /score endpoint
    app.post("/same-shape")(score)  # not declared
    app.post("/one-more")(one_more)
    app.post("/guarded", dependencies=[Depends(other_dependency)])(score)
    app.put("/put")(score)
    exact = Declared("/exact", ScoreRequest, score)
    assert set(routes_of(app, [exact, Declared("/absent", ScoreRequest, score)])) == {"/exact"}
    assert routes_of(app, []) == {}
    for wrong, why in [
        (Declared("/exact", PredictRequest, score), "takes"),  # another body than the endpoint's
        (Declared("/exact", ScoreRequest, predict), "serves"),  # another endpoint than FastAPI's
        (Declared("/one-more", ScoreRequest, one_more), "takes"),
        (Declared("/guarded", ScoreRequest, score), "dependencies"),
    ]:
        with pytest.raises(LaneMismatch, match=why):
            routes_of(app, [wrong])
    assert routes_of(app, [Declared("/put", ScoreRequest, score)]) == {}  # not a POST route: not served


def test_dependency_overrides_send_every_request_fastapis_way(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=1, replicas=1) as srv:
        lane = srv.app.state.fast_lane
        body = {"query": "drill", "titles": ["hammer"]}
        assert send(srv.url, "/score", body, {}, None).status_code == 200 and lane.served == 1
        srv.app.dependency_overrides[deps.use_cache] = lambda: False
        assert send(srv.url, "/score", body, {}, None).status_code == 200 and lane.served == 1


def test_tracing_or_the_setting_turns_the_lane_off():
    from opentelemetry.sdk.trace import TracerProvider

    from service.tracing import OtelTracing

    assert create_app(Settings()).state.fast_lane is not None
    assert create_app(Settings(fast_lane=False)).state.fast_lane is None
    assert create_app(Settings(), tracing=OtelTracing(TracerProvider())).state.fast_lane is None


def test_the_lane_reads_cache_control_as_the_route_does(pair):
    on, _ = pair
    body = {"query": "mitre saw", "titles": ["12 in. sliding compound mitre saw"]}
    assert send(on.url, "/score", body, {}, None).status_code == 200
    hits = on.metric("qtrel_cache_hits_total")
    assert send(on.url, "/score", body, {"cache-control": "max-age=0, No-Cache"}, None).status_code == 200
    assert on.metric("qtrel_cache_hits_total") == hits  # scored afresh
    assert send(on.url, "/score", body, {"cache-control": "max-age=0"}, None).status_code == 200
    assert on.metric("qtrel_cache_hits_total") == hits + 1


def test_behind_a_root_path_fastapi_routes_every_request(tiny_checkpoint):
    """uvicorn --root-path: FastAPI routes on the path without it, so the lane steps aside (a /v1 prefix must
    not turn /rerank into Cohere's /v1/rerank)."""
    servers = []
    try:
        for lane in (True, False):
            s = Settings(
                model=str(tiny_checkpoint),
                port=free_port(),
                host="127.0.0.1",
                log_json=False,
                dtype="float32",
                inference="torch",
                max_wait_ms=1,
                replicas=1,
                fast_lane=lane,
            )
            srv = LiveServer(s)
            srv.server.config.root_path = "/v1"
            servers.append(srv.start())
        body = {"query": "drill", "documents": ["cordless drill", "hammer"]}
        a, b = (send(srv.url, "/rerank", body, {}, None) for srv in servers)
        same(a, b)
        assert a.status_code == 422 and servers[0].app.state.fast_lane.served == 0
    finally:
        for srv in servers:
            srv.stop()


def test_fastapis_own_telemetry_or_overrides_set_later_send_requests_fastapis_way(tiny_checkpoint):
    app = create_app(Settings(model=str(tiny_checkpoint)))
    lane = app.state.fast_lane
    sent: list = []

    async def send_(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}

    def scope(**extra):
        return {"type": "http", "method": "POST", "path": "/score", "headers": [], "state": {"engine": None}, **extra}

    first = {"type": "http.request", "body": b'{"query": "a", "titles": ["b"]}', "more_body": False}
    assert not asyncio.run(lane.serve(scope(**{"fastapi.telemetry": object()}), first, receive, send_))
    app.dependency_overrides = {deps.use_cache: lambda: False}  # a new dict, not the one the lane saw at start
    assert not asyncio.run(lane.serve(scope(), first, receive, send_))
    assert sent == [] and lane.served == 0
