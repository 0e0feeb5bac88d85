"""API keys: every scoring, explanation and /info route needs `Authorization: Bearer <key>` when keys are
set; health stays open, /metrics unless protect_metrics; keys are compared in constant time and are never
logged or shown. Through a real uvicorn server on the tiny checkpoint, and the real app in a TestClient."""

from __future__ import annotations

import logging
import time

import httpx
import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service import app as app_module
from service.app import create_app
from service.cli import main
from service.settings import Settings
from tests.service.conftest import live_server

KEY_A, KEY_B, KEY_FILE = "key-a-0123456789", "key-b-abcdefghij", "key-from-file-xyz"
QUERY = {"query": "cordless drill", "titles": ["DEWALT 20V MAX Cordless Drill"]}
PROTECTED = [  # (method, path, body)
    ("POST", "/score", QUERY),
    ("POST", "/predict", {"inputs": ["cordless drill", "DEWALT drill"]}),
    ("POST", "/rerank", {"query": "drill", "texts": ["cordless drill", "hammer"]}),
    ("POST", "/explain", {"query": "drill", "title": "cordless drill"}),
    ("GET", "/info", None),
]
OPEN = ["/health/live", "/health/ready", "/livez", "/readyz", "/metrics", "/explain/view", "/docs", "/openapi.json"]
BAD_AUTH = [
    None,
    "",
    "Bearer",
    "Basic a2V5LWEtMDEyMzQ1Njc4OQ==",
    f"Token {KEY_A}",
    "Bearer wrong",
    f"Bearer {KEY_A}x",
    f"Bearer {KEY_A[:-1]}",
    f"Bearer {KEY_A},{KEY_B}",
    "Bearer ключ".encode(),
    f"Bearer {KEY_A}\xe9".encode("latin-1"),
]


def key_file(tmp_path, *lines: str):
    path = tmp_path / "keys"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def locked(tiny_checkpoint, tmp_path_factory):
    path = key_file(tmp_path_factory.mktemp("keys"), "# qtrel keys", "", f"  {KEY_FILE}  ", "# rotated: old")
    with live_server(
        tiny_checkpoint, max_wait_ms=5, api_keys=f"{KEY_A}, {KEY_B}", api_keys_file=str(path), replicas=1
    ) as srv:
        yield srv


def call(srv, method, path, body=None, auth=None):
    headers = {} if auth is None else {"Authorization": auth}
    return httpx.request(method, srv.url + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_protected_routes_refuse_a_missing_malformed_or_wrong_key(locked, method, path, body):
    for auth in BAD_AUTH:
        r = call(locked, method, path, body, auth)
        assert r.status_code == 401, (auth, r.status_code, r.text)
        assert r.json()["error_type"] == "unauthorized" and set(r.json()) == {"error", "error_type"}
        assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("method,path,body", PROTECTED)
def test_every_configured_key_opens_the_protected_routes(locked, method, path, body):
    for key in (KEY_A, KEY_B, KEY_FILE):
        for scheme in ("Bearer", "bearer"):
            r = call(locked, method, path, body, f"{scheme} {key}")
            assert r.status_code == 200, (key, r.text)


@pytest.mark.parametrize("path", OPEN)
def test_health_metrics_docs_and_the_view_page_stay_open(locked, path):
    r = call(locked, "GET", path)
    assert r.status_code == 200, r.text


def test_a_refused_request_never_reaches_the_model(locked):
    before = locked.metric("qtrel_pairs_total")
    for _ in range(5):
        assert call(locked, "POST", "/score", QUERY, "Bearer nope").status_code == 401
    assert locked.metric("qtrel_pairs_total") == before
    assert locked.metric("qtrel_requests_total", route="/score", status="401") >= 5


def test_keys_are_never_shown_in_info_or_errors(locked):
    info = call(locked, "GET", "/info", auth=f"Bearer {KEY_A}")
    assert info.json()["settings"]["api_keys"] == "<3 redacted>"
    assert info.json()["settings"]["api_keys_file"].endswith("keys")
    for key in (KEY_A, KEY_B, KEY_FILE):
        assert key not in info.text
        assert key not in repr(locked.settings) and key not in str(locked.settings.public())
    wrong = call(locked, "POST", "/score", QUERY, f"Bearer {KEY_A}x")
    assert KEY_A not in wrong.text


def test_the_openapi_schema_names_the_bearer_scheme_on_protected_routes_only(locked):
    spec = call(locked, "GET", "/openapi.json").json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert spec["paths"]["/score"]["post"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in spec["paths"]["/health/ready"]["get"]
    assert "security" not in spec["paths"]["/metrics"]["get"]


def tc_settings(model_dir, **overrides) -> Settings:
    return Settings(
        model=str(model_dir), device="cpu", dtype="float32", worker="thread", warmup=False, log_json=False, **overrides
    )


def ready_client(app) -> TestClient:
    client = TestClient(app).__enter__()
    deadline = time.monotonic() + 60
    while client.get("/health/ready").status_code != 200:
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.02)
    return client


def test_protect_metrics_and_a_router_added_to_the_protected_list(tiny_checkpoint, monkeypatch, caplog):
    """How a new router (e.g. /v1/rerank, /tokenize) gets protected: it is added to PROTECTED_ROUTERS."""
    extra = APIRouter()

    @extra.post("/v9/added")
    async def added():
        return {"ok": True}

    monkeypatch.setattr(app_module, "PROTECTED_ROUTERS", [*app_module.PROTECTED_ROUTERS, extra])
    app = create_app(tc_settings(tiny_checkpoint, api_keys=KEY_A, protect_metrics=True))
    caplog.set_level(logging.DEBUG)
    client = ready_client(app)
    try:
        for path in ("/metrics", "/v9/added"):
            method = client.get if path == "/metrics" else client.post
            assert method(path).status_code == 401
            assert method(path, headers={"Authorization": f"Bearer {KEY_A}x"}).status_code == 401
            assert method(path, headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
        assert client.get("/health/ready").status_code == 200
        assert client.post("/score", json=QUERY, headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
    finally:
        client.__exit__(None, None, None)
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "/v9/added" in logged and KEY_A not in logged  # requests are logged, their keys never


def test_every_route_but_the_open_ones_is_protected(tiny_checkpoint):
    """A route added to the app outside the protected group fails here: add its router to PROTECTED_ROUTERS
    (or, if it must be open, to OPEN above, with a reason)."""
    paths = create_app(tc_settings(tiny_checkpoint, api_keys=KEY_A)).openapi()["paths"]
    unprotected = sorted(
        f"{m.upper()} {p}"
        for p, ops in paths.items()
        for m, op in ops.items()
        if p not in OPEN and op.get("security") != [{"HTTPBearer": []}]
    )
    assert unprotected == []
    assert {p for _, p, _ in PROTECTED} <= set(paths)


def test_without_keys_everything_is_open_and_the_schema_names_no_key(tiny_checkpoint):
    app = create_app(tc_settings(tiny_checkpoint))
    assert "securitySchemes" not in app.openapi().get("components", {})
    client = ready_client(app)
    try:
        assert client.post("/score", json=QUERY).status_code == 200
        assert client.get("/info").json()["settings"]["api_keys"] == ""
    finally:
        client.__exit__(None, None, None)


# --- settings ---------------------------------------------------------------------------------------
def test_keys_come_from_the_environment_and_a_file(monkeypatch, tmp_path):
    path = key_file(tmp_path, "# comment", "", " one ", "two#not-a-comment", "  # indented comment")
    monkeypatch.setenv("QTREL_API_KEYS", " a,b ,, c")
    monkeypatch.setenv("QTREL_API_KEYS_FILE", str(path))
    monkeypatch.setenv("QTREL_PROTECT_METRICS", "true")
    s = Settings()
    assert s.keys == ("a", "b", "c", "one", "two#not-a-comment") and s.protect_metrics
    assert Settings(api_keys="", api_keys_file=None).keys == ()


def test_a_missing_unreadable_or_empty_key_file_refuses_to_start(tmp_path, capsys):
    with pytest.raises(ValidationError, match="api_keys_file .* cannot be read: FileNotFoundError"):
        Settings(api_keys_file=str(tmp_path / "absent"))
    with pytest.raises(ValidationError, match="cannot be read: IsADirectoryError"):
        Settings(api_keys_file=str(tmp_path))
    with pytest.raises(ValidationError, match="holds no key"):
        Settings(api_keys_file=str(key_file(tmp_path, "# only a comment", "")))
    assert main(["serve", "--api-keys-file", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert "invalid settings" in err and "absent" in err and "cannot be read" in err
