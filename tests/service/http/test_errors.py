"""Errors: one table from kind to status, one JSON shape, installed once on an app."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from service.errors import ErrorKind, ServiceError
from service.http import errors
from service.http.errors import STATUS, error_response
from service.runtime.engine import (
    Closed,
    DeadlineExceeded,
    InferenceFailed,
    InputTooLong,
    NotReady,
    Overloaded,
)


def test_every_kind_has_one_status():
    assert set(STATUS) == set(ErrorKind)
    assert STATUS[ErrorKind.OVERLOADED] == STATUS[ErrorKind.RATE_LIMITED] == 429
    assert STATUS[ErrorKind.NOT_READY] == 503 and STATUS[ErrorKind.BACKEND] == 500
    assert STATUS[ErrorKind.CLIENT_CLOSED] == 499 and STATUS[ErrorKind.TIMEOUT] == 408


@pytest.mark.parametrize(("retry_after", "header"), [(None, None), (0.2, "1"), (2.6, "3"), (30, "30")])
def test_error_response_shape_and_retry_after(retry_after, header):
    r = error_response(ErrorKind.OVERLOADED, "queue full", retry_after)
    assert r.status_code == 429
    assert r.body == b'{"error":"queue full","error_type":"overloaded"}'
    assert r.headers.get("retry-after") == header


class Body(BaseModel):
    n: int


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    errors.install(app)

    @app.post("/echo")
    async def echo(body: Body):
        return {"n": body.n}

    @app.get("/refuse")
    async def refuse():
        raise ServiceError(ErrorKind.NOT_READY, "not ready: loading", retry_after=1)

    @app.get("/crash")
    async def crash():
        return 1 / 0

    runtime = {
        "overloaded": Overloaded("pairs", 3.0),
        "closed": Closed("draining: no new work is accepted"),
        "not_ready": NotReady("warming"),
        "deadline": DeadlineExceeded("deadline passed while queued"),
        "too_long": InputTooLong(2, 128),
        "failed": InferenceFailed("inference failed: boom"),
    }

    @app.get("/runtime/{name}")
    async def raise_runtime(name: str):
        raise runtime[name]

    return TestClient(app, raise_server_exceptions=False)


def shape(r):
    body = r.json()
    assert set(body) == {"error", "error_type"}, body
    return body["error_type"], body["error"]


def test_a_service_error_is_mapped_by_its_kind(client):
    r = client.get("/refuse")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert shape(r) == ("not_ready", "not ready: loading")


def test_validation_errors_name_the_field_and_bad_json_is_a_bad_request(client):
    r = client.post("/echo", json={"n": "x"})
    kind, message = shape(r)
    assert r.status_code == 422 and kind == "validation" and message.startswith("n: ")
    r = client.post("/echo", content=b"{not json", headers={"content-type": "application/json"})
    kind, message = shape(r)
    assert r.status_code == 400 and kind == "bad_request" and "not valid JSON" in message


@pytest.mark.parametrize("ctype", [None, "application/x-www-form-urlencoded", "text/plain; charset=utf-8"])
def test_a_body_not_sent_as_json_is_told_so(client, ctype):
    """`curl -d` sends a form's content type: FastAPI then does not read the body as JSON at all."""
    headers = {} if ctype is None else {"content-type": ctype}
    r = client.post("/echo", content=b'{"n": 1}', headers=headers)
    kind, message = shape(r)
    assert r.status_code == 422 and kind == "validation"
    assert "Content-Type: application/json" in message and f"this request's: {ctype or 'none'}" in message
    ok = client.post("/echo", content=b'{"n": 1}', headers={"content-type": "application/merge-patch+json"})
    assert ok.status_code == 200
    r = client.post("/echo", content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 422 and "Content-Type" not in shape(r)[1]  # JSON, just not an object


def test_starlette_errors_get_the_shape(client):
    assert client.get("/nowhere").status_code == 404 and shape(client.get("/nowhere"))[0] == "not_found"
    r = client.get("/echo")
    assert r.status_code == 405 and shape(r)[0] == "method_not_allowed"


def test_anything_unexpected_is_a_500_that_names_only_its_type(client):
    r = client.get("/crash")
    assert r.status_code == 500 and shape(r) == ("backend", "internal error: ZeroDivisionError")


@pytest.mark.parametrize(
    ("name", "status", "kind", "retry_after"),
    [
        ("overloaded", 429, "overloaded", "3"),
        ("closed", 503, "not_ready", "1"),
        ("not_ready", 503, "not_ready", "1"),
        ("deadline", 408, "timeout", None),
        ("too_long", 413, "payload_too_large", None),
        ("failed", 500, "backend", None),
    ],
)
def test_the_runtimes_own_errors_are_mapped_once(client, name, status, kind, retry_after):
    r = client.get(f"/runtime/{name}")
    assert r.status_code == status and shape(r)[0] == kind
    assert r.headers.get("retry-after") == retry_after
