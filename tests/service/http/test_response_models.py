"""What the routes answer is what they declare: a real answer of every JSON route of the app, from a real
server on the tiny checkpoint through the real lifespan (the fast lane on, as served by default), validates
against the route's `response_model` and carries no field the model leaves out. Most endpoints return their
JSON themselves (FastAPI then checks nothing), and the fast lane never passes FastAPI's serialisation, so
the OpenAPI schema is only as true as this test."""

from __future__ import annotations

import httpx
import pytest
from fastapi.routing import APIRoute, iter_route_contexts
from pydantic import TypeAdapter

from tests.service.conftest import live_server

ADMIN = "admin-key-0123456789"
LONG_TITLE = " ".join(["cordless drill with battery and charger kit"] * 40)

# (method, path, body) per route, several where optional fields appear only on some answers (windows, cutoffs,
# probabilities, texts). "{model}" is the served model's id.
SAMPLES: dict[tuple[str, str], list[dict | None]] = {
    ("POST", "/score"): [
        {"query": "cordless drill", "titles": ["DEWALT 20V drill", "garden hose"]},
        {"pairs": [{"query": "drill", "title": "hammer"}], "return_probs": False, "top_n": 1},
        {"query": "drill", "titles": [LONG_TITLE, "hammer"], "max_chunks": 3, "min_level": 2},
        {"query": "drill", "titles": ["hammer", "drill"], "min_score": 0.5, "truncation": "only_second"},
    ],
    ("POST", "/predict"): [
        {"inputs": ["cordless drill", "DEWALT drill"]},
        {"inputs": [["drill", "hammer"], ["saw", "circular saw"]], "raw_scores": True},
    ],
    ("POST", "/rerank"): [
        {"query": "drill", "texts": ["cordless drill", "hammer"], "return_text": True},
        {"query": "drill", "texts": [LONG_TITLE, "hammer"], "raw_scores": True, "max_chunks": 2},
    ],
    ("POST", "/v1/rerank"): [
        {"query": "drill", "documents": ["cordless drill", "hammer"], "top_n": 1},
        {"query": "drill", "documents": ["cordless drill", "hammer"], "return_documents": True, "min_level": 3},
    ],
    ("POST", "/v2/rerank"): [
        {"query": "drill", "documents": [{"text": "cordless drill", "id": "a"}, "hammer"], "return_documents": True},
        {"query": "drill", "documents": [LONG_TITLE], "max_chunks_per_doc": 2, "min_score": 0.1},
    ],
    ("POST", "/tokenize"): [
        {"query": "cordless drill", "title": "DEWALT 20V MAX Cordless Drill"},
        {"pairs": [{"query": "drill", "title": LONG_TITLE}]},
    ],
    ("POST", "/explain"): [
        {"query": "drill", "title": "cordless drill"},
        {"query": "drill", "title": "cordless drill", "attention": True, "top_heads": 2},
    ],
    ("GET", "/info"): [None],
    ("GET", "/v1/models"): [None],
    ("GET", "/v1/models/{model_id:path}"): [None],
    ("POST", "/admin/models/{name}/reload"): [None],  # last: the model is swapped for a fresh copy
}
# JSON routes without a response_model, so nothing to hold them to: a new one goes here or, better, declares one.
UNDECLARED = {
    ("GET", "/health/live"),
    ("GET", "/livez"),
    ("GET", "/health/ready"),
    ("GET", "/readyz"),
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/{job_id}"),
    ("POST", "/v1/jobs/{job_id}/cancel"),
    ("DELETE", "/v1/jobs/{job_id}"),
    ("GET", "/v1/jobs/{job_id}/output"),
}


def json_routes(app) -> dict[tuple[str, str], APIRoute]:
    """(method, path) -> route, for every API route that answers JSON (not /metrics' text or a page)."""
    out = {}
    for c in iter_route_contexts(app.routes):
        route = c.original_route
        if isinstance(route, APIRoute) and getattr(route.response_class, "media_type", "application/json") in (
            None,
            "application/json",
        ):
            for method in c.methods:
                out[(method, c.path)] = route
    return out


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    jobs = tmp_path_factory.mktemp("jobs")
    with live_server(tiny_checkpoint, max_wait_ms=1, replicas=1, admin_keys=ADMIN, jobs_dir=jobs) as srv:
        yield srv


def test_every_json_route_has_a_sample_or_says_it_declares_no_model(served):
    routes = json_routes(served.app)
    declared = {k for k, r in routes.items() if r.response_model is not None}
    assert declared == set(SAMPLES), "add a sample request for each new route with a response_model"
    assert set(routes) - declared == UNDECLARED


def test_every_answer_validates_against_its_response_model(served):
    routes = json_routes(served.app)
    model_id = httpx.get(served.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    checked = 0
    for (method, path), bodies in SAMPLES.items():
        adapter = TypeAdapter(routes[(method, path)].response_model)
        url = served.url + path.replace("{model_id:path}", model_id).replace("{name}", model_id)
        headers = {"authorization": f"Bearer {ADMIN}"} if path.startswith("/admin/") else {}
        for body in bodies:
            r = httpx.request(method, url, json=body, headers=headers, timeout=120)
            assert r.status_code == 200, (method, path, body, r.text)
            got = r.json()
            value = adapter.validate_json(r.content)  # JSON mode: what a client's generated model accepts
            # nothing the model leaves out: the answer is the model's dump of what it read
            assert adapter.dump_python(value, mode="json", exclude_unset=True) == got, (method, path, body)
            checked += 1
    assert checked == sum(len(b) for b in SAMPLES.values())


def test_a_field_the_model_leaves_out_is_caught():
    from service.http.schemas import ScoreResponse

    adapter = TypeAdapter(ScoreResponse)
    good = {"model": "m", "results": []}
    value = adapter.validate_python(good)
    assert adapter.dump_python(value, mode="json", exclude_unset=True) == good
    extra = {**good, "surprise": 1}
    assert adapter.dump_python(adapter.validate_python(extra), mode="json", exclude_unset=True) != extra
