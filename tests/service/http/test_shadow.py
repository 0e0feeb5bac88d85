"""A shadow model on a live server: a sample of the default model's pairs scored again off the request
path; the shadow metrics move, agree fully for the same checkpoint, and a full queue drops and counts."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.service.conftest import live_server

TITLES = [f"cordless drill {i}" for i in range(40)]


@pytest.fixture(scope="module")
def candidate(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cand") / "candidate", seed=1)


def wait_for(srv, name: str, at_least: float, **labels) -> float:
    deadline = time.monotonic() + 60
    while (value := srv.metric(name, **labels)) < at_least:
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.1)
    return value


@pytest.mark.parametrize("same", [True, False])
def test_every_pair_shadowed_with_agreement_and_differences(tiny_checkpoint, candidate, same):
    shadow = f"cand={tiny_checkpoint if same else candidate}"
    with live_server(tiny_checkpoint, shadow=shadow, shadow_rate=1.0, warmup=False) as srv:
        wait_for(srv, "qtrel_model_info", 0)  # ready
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/info").json()["shadow"]["state"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.post(srv.url + "/score", json={"query": "drill", "titles": TITLES})
        assert r.status_code == 200 and r.json()["model"] == "tiny-bert"  # the live model answers
        pairs = wait_for(srv, "qtrel_shadow_pairs_total", len(TITLES), model="cand")
        assert pairs == len(TITLES)
        agreed = srv.metric("qtrel_shadow_agreed_total", model="cand")
        assert srv.metric("qtrel_shadow_score_diff_count", model="cand") == pairs
        diff = srv.metric("qtrel_shadow_score_abs_diff_total", model="cand")
        if same:  # the same weights: every level agrees, no difference
            assert agreed == pairs and diff == pytest.approx(0, abs=1e-6)
        else:
            assert agreed <= pairs and diff > 1e-3
        info = httpx.get(srv.url + "/info").json()["shadow"]
        assert info["id"] == "cand" and info["rate"] == 1.0


def test_a_full_shadow_queue_drops_and_counts_without_touching_live(tiny_checkpoint, candidate):
    with live_server(tiny_checkpoint, shadow=f"cand={candidate}", shadow_rate=1.0, shadow_queue_pairs=5) as srv:
        r = httpx.post(srv.url + "/score", json={"query": "drill", "titles": TITLES})
        assert r.status_code == 200
        dropped = srv.metric("qtrel_shadow_dropped_total", model="cand")
        assert dropped >= len(TITLES) - 5  # not ready yet, or the queue holds 5
        assert srv.metric("qtrel_shadow_pairs_total", model="cand") <= 5


def test_sighup_reloads_the_shadow_too(tiny_checkpoint, candidate):
    with live_server(tiny_checkpoint, shadow=f"cand={candidate}", shadow_rate=1.0, worker="thread") as srv:
        deadline = time.monotonic() + 60
        while httpx.get(srv.url + "/info").json()["shadow"]["state"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        srv.lifecycle.hangup()  # as SIGHUP does
        while (info := httpx.get(srv.url + "/info").json())["shadow"]["generation"] != 2:
            assert time.monotonic() < deadline, info["shadow"]
            time.sleep(0.1)
        assert info["models"][0]["generation"] == 2 and info["shadow"]["state"] == "ready"
        assert httpx.post(srv.url + "/score", json={"query": "drill", "titles": TITLES[:4]}).status_code == 200
        wait_for(srv, "qtrel_shadow_pairs_total", 4, model="cand")
        assert srv.metric("qtrel_model_reloads_total", model="cand", result="ok") == 1
