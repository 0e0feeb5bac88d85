"""Query and title texts stay out of the logs unless log_texts is on: through a live server on the tiny
checkpoint, every scoring route, a refused body, a too-long text, a failing forward pass (the batcher's error
log) and an unhandled error that quotes the texts (errors' and uvicorn's tracebacks) leave no log record that
holds them; with log_texts on, the texts are logged for debugging."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import APIRouter

from service import app as app_module
from service.http.deps import SettingsDep
from service.http.routes import check_limits
from service.http.schemas import ScoreRequest
from service.logs import REDACTED, JsonFormatter, keep_private, private_texts, redact_private_texts
from tests.service.conftest import live_server
from tests.service.runtime.workers.hooked import FailNext, serve_hooked

QUERY, TITLE = "zyxwv private query 7731", "qwerty private title 4419"
leaky = APIRouter()


@leaky.post("/v9/leaky")
async def leaky_route(body: ScoreRequest, settings: SettingsDep):
    """A route with a bug whose exception message quotes the texts, as a careless library might."""
    queries, titles = body.as_pairs()
    check_limits(settings, queries, titles)
    raise ValueError(f"cannot score {titles[0]!r} for {queries[0]}")


def everything_logged(records: list[logging.LogRecord]) -> str:
    """Each record of the server as a formatter prints it (traceback included) and all its attributes (the
    test's HTTP client logs too, in this process: those are left out)."""
    fmt = logging.Formatter("%(name)s %(message)s")
    server = [r for r in records if not r.name.startswith(("httpx", "httpcore"))]
    return "\n".join(f"{fmt.format(r)} {vars(r)!r}" for r in server)


def exercise(srv, fault: FailNext) -> None:
    """Every path that could log a request's texts, each with the private texts; `fault` is the thread model's."""
    url = srv.url
    ok = [
        ("/score", {"query": QUERY, "titles": [TITLE, "garden hose"]}),
        ("/predict", {"inputs": [[QUERY, TITLE]]}),
        ("/rerank", {"query": QUERY, "texts": [TITLE], "return_text": True}),
        ("/v1/rerank", {"query": QUERY, "documents": [TITLE]}),
        ("/tokenize", {"query": QUERY, "title": TITLE}),
        ("/explain", {"query": QUERY, "title": TITLE}),
    ]
    for path, body in ok:
        assert httpx.post(url + path, json=body, timeout=60).status_code == 200, path
    refused = httpx.post(url + "/score", json={"query": QUERY, "titles": [TITLE, " "], "x": TITLE})
    assert refused.status_code == 422
    assert httpx.post(url + "/score", json={"query": QUERY, "titles": [TITLE * 3]}).status_code == 413
    assert httpx.get(url + "/explain/view", params={"query": QUERY, "title": TITLE}).status_code == 200
    fault.arm()  # fail the model's next forward pass
    fresh = {"Cache-Control": "no-cache"}  # the pair was scored above: past the cache, to the failing forward
    assert httpx.post(url + "/score", json={"query": QUERY, "titles": [TITLE]}, headers=fresh).status_code == 500
    assert httpx.post(url + "/v9/leaky", json={"query": QUERY, "titles": [TITLE]}).status_code == 500


@pytest.fixture
def with_leaky_route(monkeypatch):
    monkeypatch.setattr(app_module, "PROTECTED_ROUTERS", [*app_module.PROTECTED_ROUTERS, leaky])


@pytest.mark.parametrize("log_texts", [False, True])
def test_texts_reach_the_logs_only_with_log_texts(tiny_checkpoint, caplog, with_leaky_route, log_texts, monkeypatch):
    caplog.set_level(logging.DEBUG)
    fault = FailNext()
    serve_hooked(monkeypatch, "thread", fault)
    with live_server(tiny_checkpoint, worker="thread", max_text_chars=60, log_texts=log_texts) as srv:
        exercise(srv, fault)
    logged = everything_logged(caplog.records)
    # the paths ran and logged: the refusal, the failed batch, the unhandled error with its traceback
    assert "refused (validation)" in logged and "injected fault" in logged and "unhandled error" in logged
    assert "Exception in ASGI application" in logged
    if log_texts:
        assert QUERY in logged and TITLE in logged
        assert any(QUERY in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)  # texts
        assert any(TITLE in r.getMessage() for r in caplog.records if "refused" in r.getMessage())  # values
    else:
        assert QUERY not in logged and TITLE not in logged
        assert f"cannot score '{REDACTED}' for {REDACTED}" in logged  # the traceback, redacted


def test_a_record_made_while_a_request_runs_has_its_texts_replaced(caplog):
    """The safety net alone: message, arguments and traceback; the JSON formatter prints the redacted one.
    Texts under 3 characters are left alone (they would match everywhere); other contexts are untouched."""
    redact_private_texts()
    redact_private_texts()  # installed once
    log = logging.getLogger("qtrel.test")
    caplog.set_level(logging.INFO)
    token = private_texts.set(())
    try:
        keep_private(["drill", TITLE, "ab", TITLE])
        try:
            raise KeyError(f"no {TITLE}")
        except KeyError as e:
            log.error("failed on %s", e, exc_info=True)
        log.info("a query of ab and a drill")
    finally:
        private_texts.reset(token)
    log.info("outside: %s", TITLE)
    failed, plain, outside = caplog.records[-3:]
    assert failed.getMessage() == f"failed on 'no {REDACTED}'" and failed.exc_info is None
    assert f"KeyError: 'no {REDACTED}'" in failed.exc_text and TITLE not in failed.exc_text
    assert TITLE not in JsonFormatter().format(failed) and "Traceback" in JsonFormatter().format(failed)
    assert plain.getMessage() == f"a query of ab and a {REDACTED}"
    assert outside.getMessage() == f"outside: {TITLE}"
