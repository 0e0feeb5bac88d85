"""GET /v1/models/{id}: OpenAI's models.retrieve, the one model by its id; 404 in the error shape otherwise."""

from __future__ import annotations

import httpx
import pytest


def test_a_served_id_answers_its_card_as_the_listing_does(server):
    listing = httpx.get(server.url + "/v1/models").json()["data"]
    for card in listing:
        r = httpx.get(f"{server.url}/v1/models/{card['id']}")
        assert r.status_code == 200, r.text
        assert r.json() == card
        assert r.json()["object"] == "model" and r.json()["owned_by"] == "qtrel"


@pytest.mark.parametrize("name", ["no-such-model", "org/no-such-model"])
def test_an_unknown_id_is_404_model_not_found_naming_the_served(server, name):
    r = httpx.get(f"{server.url}/v1/models/{name}")
    assert r.status_code == 404
    assert r.json() == {
        "error": f"model {name!r} is not served; served: tiny-bert",
        "error_type": "model_not_found",
    }


def test_openapi_lists_the_route(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/models/{model_id}" in spec["paths"]


def test_openai_sdk_retrieves_it(server):
    openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install openai)")
    client = openai.OpenAI(api_key="x", base_url=server.url + "/v1")
    assert client.models.retrieve("tiny-bert").id == "tiny-bert"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
