"""A model that cannot read a text says so: the English default on a Chinese pair reports its unknown-token
share and warns; a setting refuses such pairs with a 422; /v1/models names the languages each model reads."""

from __future__ import annotations

import httpx
import pytest

from model.builtin import builtin_dir
from tests.service.conftest import live_server

CHINESE = {"query": "离婚申请", "titles": ["苹果手机价格"]}  # divorce application / iPhone prices
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
