"""The service end to end: a real uvicorn server, the real lifespan, the tiny real checkpoint."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from model.relevance import RelevanceModel
from tests.conftest import read_pairs
from tests.service.conftest import live_server, run
from tests.service.runtime.workers.hooked import FailNext, serve_hooked


def reference_scores(model_dir, pairs):
    """Each pair scored alone, unbatched: what the service must return whatever the batch was (its level's
    label, expected level as `score`, probabilities, tokens and truncation, as the service answers them)."""
    m = RelevanceModel.load(model_dir)
    out = []
    for p in pairs:
        (s,), enc = m.predict([p]), m.encode([p])
        level, tokens, truncated = m.labels[s.level], enc.lengths[0], enc.truncated[0]
        out.append(SimpleNamespace(level=level, score=s.expected, probs=s.probs, tokens=tokens, truncated=truncated))
    return out


def test_score_matches_unbatched_forward_under_concurrency(server, tiny_checkpoint):
    pairs = read_pairs(120)
    ref = reference_scores(tiny_checkpoint, pairs)
    rng = random.Random(0)
    # Requests of mixed sizes and both body forms, sent at once.
    chunks, i = [], 0
    while i < len(pairs):
        n = rng.choice([1, 1, 2, 5, 13])
        chunks.append((i, pairs[i : i + n]))
        i += n

    async def send(client, start, chunk):
        if len(chunk) > 1 and len({q for q, _ in chunk}) == 1:
            body = {"query": chunk[0][0], "titles": [t for _, t in chunk]}
        else:
            body = {"pairs": [{"query": q, "title": t} for q, t in chunk]}
        r = await client.post(server.url + "/score", json=body)
        assert r.status_code == 200, r.text
        return start, r.json()

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(send(client, s, c) for s, c in chunks))

    for start, body in run(main()):
        for res in body["results"]:
            want = ref[start + res["index"]]
            assert res["level"] == want.level
            assert res["score"] == pytest.approx(want.score, abs=1e-4)
            assert list(res["probs"].values()) == pytest.approx(want.probs, abs=1e-4)
            assert res["tokens"] == want.tokens and res["truncated"] == want.truncated


def test_concurrent_requests_are_merged_into_batches(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=100) as srv:
        pairs = read_pairs(24)

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                rs = await asyncio.gather(
                    *(client.post(srv.url + "/score", json={"query": q, "titles": [t]}) for q, t in pairs)
                )
                assert all(r.status_code == 200 for r in rs)

        run(main())
        batches = srv.metric("qtrel_batch_pairs_count")
        assert srv.metric("qtrel_batch_pairs_sum") == 24
        assert batches < 24  # several one-pair requests shared a forward pass
        assert srv.metric("qtrel_pairs_total") == 24


def test_top_n_sorted_and_probs_optional(server):
    titles = [t for _, t in read_pairs(30)]
    r = httpx.post(
        server.url + "/score", json={"query": "cordless drill", "titles": titles, "top_n": 5, "return_probs": False}
    )
    assert r.status_code == 200
    res = r.json()["results"]
    assert len(res) == 5 and all("probs" not in x for x in res)
    scores = [x["score"] for x in res]
    assert scores == sorted(scores, reverse=True)
    full = httpx.post(server.url + "/score", json={"query": "cordless drill", "titles": titles}).json()["results"]
    assert max(x["score"] for x in full) == pytest.approx(scores[0])
    assert [x["index"] for x in full] == list(range(30))


def test_large_request_is_split_over_batches_and_reassembled(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_batch_tokens=512, max_batch_size=16) as srv:
        pairs = read_pairs(300)
        r = httpx.post(srv.url + "/score", json={"pairs": [{"query": q, "title": t} for q, t in pairs]}, timeout=60)
        assert r.status_code == 200
        res = r.json()["results"]
        assert [x["index"] for x in res] == list(range(300))
        assert srv.metric("qtrel_batch_pairs_count") >= 300 / 16
        ref = reference_scores(srv.settings.model, pairs[:20])
        for x, want in zip(res[:20], ref):
            assert x["score"] == pytest.approx(want.score, abs=1e-4)


def test_tei_predict_and_rerank(server, tiny_checkpoint):
    pairs = read_pairs(6)
    ref = reference_scores(tiny_checkpoint, pairs)
    r = httpx.post(server.url + "/predict", json={"inputs": [list(p) for p in pairs]})
    assert r.status_code == 200
    for preds, want in zip(r.json(), ref):
        assert [p["score"] for p in preds] == sorted((p["score"] for p in preds), reverse=True)
        assert preds[0]["label"] == want.level
        assert sum(p["score"] for p in preds) == pytest.approx(1.0, abs=1e-5)
    single = httpx.post(server.url + "/predict", json={"inputs": list(pairs[0]), "raw_scores": True}).json()
    assert isinstance(single[0], dict) and single[0]["label"] == ref[0].level
    q = pairs[0][0]
    texts = [t for _, t in read_pairs(10)]
    ranks = httpx.post(server.url + "/rerank", json={"query": q, "texts": texts, "return_text": True}).json()
    assert sorted(x["index"] for x in ranks) == list(range(10))
    assert [x["score"] for x in ranks] == sorted((x["score"] for x in ranks), reverse=True)
    assert all(x["text"] == texts[x["index"]] for x in ranks)
    # truncate=false refuses an input longer than the model takes, as TEI does
    long = {"query": q, "texts": ["drill " * 300]}
    assert httpx.post(server.url + "/rerank", json=long).status_code == 413
    assert httpx.post(server.url + "/rerank", json={**long, "truncate": True}).status_code == 200


BAD_BODIES = [
    ({}, 422),
    ([], 422),
    ("just a string", 422),
    ({"query": "q"}, 422),
    ({"titles": ["t"]}, 422),
    ({"query": "q", "titles": []}, 422),
    ({"query": "", "titles": ["t"]}, 422),
    ({"query": "q", "titles": ["   "]}, 422),
    ({"query": "q", "titles": [1, 2]}, 422),
    ({"query": 5, "titles": ["t"]}, 422),
    ({"query": "q", "titles": "t"}, 422),
    ({"query": "q", "titles": [None]}, 422),
    ({"query": "q", "titles": [["nested"]]}, 422),
    ({"query": "q", "titles": ["t"], "pairs": [{"query": "q", "title": "t"}]}, 422),
    ({"pairs": []}, 422),
    ({"pairs": [{"query": "q"}]}, 422),
    ({"pairs": [["q", "t"]]}, 422),
    ({"pairs": [{"query": "q", "title": "t", "x": 1}]}, 422),
    ({"query": "q", "titles": ["t"], "truncation": "middle"}, 422),
    ({"query": "q", "titles": ["t"], "top_n": 0}, 422),
    ({"query": "q", "titles": ["t"], "top_n": "3"}, 422),
    ({"query": "q", "titles": ["t"], "return_probs": "yes"}, 422),
    ({"query": "q", "titles": ["t"], "unknown_option": True}, 422),
]


@pytest.mark.parametrize("body,status", BAD_BODIES)
def test_malformed_bodies_get_4xx_with_error_shape(server, body, status):
    r = httpx.post(server.url + "/score", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"error", "error_type"} and err["error"]


@pytest.mark.parametrize(
    "content,headers",
    [
        (b"{not json", {"content-type": "application/json"}),
        (b'{"query": "\xff\xfe", "titles": ["t"]}', {"content-type": "application/json"}),
        (b"", {"content-type": "application/json"}),
        (b"query=q", {"content-type": "application/x-www-form-urlencoded"}),
        (b"\x00\x01\x02", {"content-type": "application/octet-stream"}),
    ],
)
def test_unreadable_bodies_get_4xx(server, content, headers):
    r = httpx.post(server.url + "/score", content=content, headers=headers)
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()) == {"error", "error_type"}


def test_tei_routes_reject_bad_input(server):
    for route, body in [
        ("/predict", {"inputs": []}),
        ("/predict", {"inputs": [["only one"]]}),
        ("/predict", {"inputs": [["a", "b", "c"]]}),
        ("/predict", {"inputs": [["a", ""]]}),
        ("/rerank", {"query": "q", "texts": []}),
        ("/rerank", {"query": "", "texts": ["t"]}),
        ("/rerank", {"query": "q", "texts": [3]}),
        ("/predict", {"inputs": [["a", "b"]], "truncation_direction": "Up"}),
    ]:
        r = httpx.post(server.url + route, json=body)
        assert r.status_code == 422, (route, body, r.text)
        assert set(r.json()) == {"error", "error_type"}


def test_limits_give_413(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_pairs_per_request=10, max_text_chars=50, max_body_bytes=2048) as srv:
        too_many = httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"] * 11})
        assert too_many.status_code == 413 and "at most 10" in too_many.json()["error"]
        too_long = httpx.post(srv.url + "/score", json={"query": "q", "titles": ["x" * 51]})
        assert too_long.status_code == 413 and "characters" in too_long.json()["error"]
        big = httpx.post(srv.url + "/score", json={"query": "q", "titles": ["word " * 9] * 60})
        assert big.status_code == 413 and big.json()["error_type"] == "payload_too_large"

        def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b'{"query": "q", "titles": ["' + b"x" * 400 + b'"]}'

        r = httpx.post(srv.url + "/score", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert httpx.post(srv.url + "/score", json={"query": "q", "titles": ["ok"]}).status_code == 200


def test_overload_is_refused_with_retry_after(tiny_checkpoint):
    # Items wait up to 300 ms for a batch to fill, so the queue holds them while more arrive.
    with live_server(
        tiny_checkpoint, max_queue_pairs=8, max_pairs_per_request=8, max_wait_ms=300, max_batch_size=64
    ) as srv:

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(
                    *(  # distinct pairs: the same pair twice would be forwarded once and take one place
                        client.post(
                            srv.url + "/score", json={"query": "q", "titles": [f"title {j} {i}" for i in range(4)]}
                        )
                        for j in range(6)
                    )
                )

        rs = run(main())
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and 429 in codes, codes
        refused = next(r for r in rs if r.status_code == 429)
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error_type"] == "overloaded"
        assert srv.metric("qtrel_rejected_total", reason="overloaded") >= 1
        # and it recovers
        assert httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]}).status_code == 200


def test_expired_deadline_is_dropped_before_the_device(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=200, max_batch_size=64) as srv:
        before = srv.metric("qtrel_batch_pairs_sum")
        r = httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]}, headers={"X-Request-Timeout-Ms": "20"})
        assert r.status_code == 408 and r.json()["error_type"] == "timeout"
        assert srv.metric("qtrel_rejected_total", reason="deadline") == 1
        assert srv.metric("qtrel_dropped_pairs_total", reason="deadline") == 1
        assert srv.metric("qtrel_batch_pairs_sum") == before  # never reached a forward pass
        bad = httpx.post(
            srv.url + "/score", json={"query": "q", "titles": ["t"]}, headers={"X-Request-Timeout-Ms": "soon"}
        )
        assert bad.status_code == 422


def test_disconnected_client_work_is_dropped(tiny_checkpoint):
    with live_server(tiny_checkpoint, max_wait_ms=1000, max_batch_size=64) as srv:

        async def main():
            async with httpx.AsyncClient() as client:
                with pytest.raises(httpx.ReadTimeout):
                    await client.post(
                        srv.url + "/score", json={"query": "q", "titles": ["t1", "t2", "t3"]}, timeout=0.3
                    )

        run(main())
        import time

        time.sleep(1.5)
        assert srv.metric("qtrel_rejected_total", reason="disconnected") == 1
        assert srv.metric("qtrel_dropped_pairs_total", reason="cancelled") == 3
        assert srv.metric("qtrel_batch_pairs_sum") == 0
        assert srv.metric("qtrel_pairs_in_flight") == 0


def test_failing_forward_fails_only_its_batch(tiny_checkpoint, monkeypatch):
    """Fault injection (the test backend, its model on a thread): the model raises for one forward pass; that
    request gets a 500 with the error shape, and the next request is served normally."""
    fault = FailNext()
    serve_hooked(monkeypatch, "thread", fault)
    with live_server(tiny_checkpoint, worker="thread") as srv:
        fault.arm()
        r = httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]})
        assert r.status_code == 500
        assert r.json()["error_type"] == "backend" and "injected fault" in r.json()["error"]
        ok = httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/health/ready").status_code == 200


def test_model_process_killed_under_load_is_restarted(tiny_checkpoint):
    """A real crash: SIGKILL the model process while a large request is being scored in many batches.
    That request gets a 500 only if the kill hit one of its batches, never a hang; the process is
    restarted, readiness comes back, the restart is counted, and the next request is served."""
    import os
    import signal
    import threading
    import time

    with live_server(tiny_checkpoint, max_batch_size=8) as srv:
        pid = srv.engine.worker.pids[0]
        body = {"query": "cordless drill", "titles": [f"title number {i} " * 12 for i in range(1000)]}
        result = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(srv.url + "/score", json=body, timeout=60)))
        t.start()
        while srv.metric("qtrel_batch_pairs_count") < 3:
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        r = result["r"]
        assert r.status_code in (200, 500)
        if r.status_code == 500:
            assert r.json()["error_type"] == "backend" and "died" in r.json()["error"]
        for _ in range(600):
            if httpx.get(srv.url + "/health/ready").status_code == 200:
                break
            time.sleep(0.05)
        assert pid not in srv.engine.worker.pids
        assert httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]}).status_code == 200
        assert srv.metric("qtrel_worker_restarts_total") == 1


def test_a_stopped_model_process_is_replaced_without_failing_a_request(tiny_checkpoint):
    """A real hang: SIGSTOP the model process. The next batch is held past batch_timeout_s, the watchdog
    kills the process and a new one serves the retried batch: the request succeeds, the restart is
    counted as a timeout and the retry as such, and the service is ready again."""
    import os
    import signal

    with live_server(tiny_checkpoint, batch_timeout_s=1, replicas=1, threads=1) as srv:
        pid = srv.engine.worker.pids[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            r = httpx.post(srv.url + "/score", json={"query": "drill", "titles": ["a", "b", "c"]}, timeout=60)
        finally:
            if pid in srv.engine.worker.pids:
                os.kill(pid, signal.SIGKILL)
        assert r.status_code == 200 and len(r.json()["results"]) == 3
        assert pid not in srv.engine.worker.pids
        assert httpx.get(srv.url + "/health/ready").status_code == 200
        assert srv.metric("qtrel_worker_restarts_total", reason="timeout") == 1
        assert srv.metric("qtrel_worker_restarts_total", reason="died") == 0
        assert srv.metric("qtrel_batches_retried_total") == 1 and srv.metric("qtrel_batches_failed_total") == 0
        info = httpx.get(srv.url + "/info").json()
        assert info["worker"]["restarts"] == 1 and info["worker"]["batch_timeout_s"] == 1


def test_health_info_metrics(server):
    assert httpx.get(server.url + "/health/live").json() == {"status": "alive"}
    assert httpx.get(server.url + "/livez").status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 200
    info = httpx.get(server.url + "/info").json()
    assert info["levels"] == ["1", "2", "3", "4", "5"] and info["max_length"] == 128
    assert info["settings"]["max_batch_tokens"] == server.settings.max_batch_tokens
    assert info["dtype"] == "float32" and info["device"] == "cpu" and info["state"] == "ready"
    r = httpx.get(server.url + "/score")
    assert r.status_code == 405 and r.json()["error_type"] == "method_not_allowed"
    r = httpx.post(server.url + "/score", json={"query": "q", "titles": ["t"]}, headers={"X-Request-Id": "abc123"})
    assert r.headers["x-request-id"] == "abc123"
    made = {
        httpx.post(server.url + "/score", json={"query": "q", "titles": ["t"]}).headers["x-request-id"] for _ in "ab"
    }
    assert len(made) == 2 and all(len(rid) == 32 and int(rid, 16) >= 0 for rid in made)  # 128 random bits, hex
    assert httpx.get(server.url + "/openapi.json").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "qtrel_requests_total",
        "qtrel_request_duration_seconds_bucket",
        "qtrel_queue_seconds_bucket",
        "qtrel_tokenize_seconds_bucket",
        "qtrel_inference_seconds_bucket",
        "qtrel_batch_pairs_bucket",
        "qtrel_batch_tokens_bucket",
        "qtrel_batch_padding_ratio_bucket",
        "qtrel_queue_depth",
        "qtrel_pairs_in_flight",
        "qtrel_predicted_level_total",
        "qtrel_ready 1.0",
        "qtrel_model_info",
    ):
        assert name in text, name


def test_readiness_before_warmup_and_during_drain(tiny_checkpoint, monkeypatch):
    import threading

    from service.runtime.workers import runner

    gate = threading.Event()
    original = runner.load_model

    def slow_load(spec):
        gate.wait(30)  # hold the model load until the test has looked at readiness
        return original(spec)

    monkeypatch.setattr(runner, "load_model", slow_load)
    with live_server(tiny_checkpoint, wait_ready=False, worker="thread") as srv:
        r = httpx.get(srv.url + "/health/ready")
        assert r.status_code == 503 and "loading" in r.json()["error"]
        assert httpx.get(srv.url + "/health/live").status_code == 200
        assert httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]}).status_code == 503
        gate.set()
        for _ in range(200):
            if httpx.get(srv.url + "/health/ready").status_code == 200:
                break
            import time

            time.sleep(0.05)
        assert httpx.get(srv.url + "/health/ready").status_code == 200
        srv.lifecycle.begin_drain()
        r = httpx.get(srv.url + "/health/ready")
        assert r.status_code == 503 and "draining" in r.json()["error"]
        # readiness is off; a request that still reaches the server is answered (the listener closes on SIGTERM)
        assert httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]}).status_code == 200


@pytest.mark.parametrize("inference", ["openvino", "auto"])
def test_info_says_what_runs_the_forward_and_why(tiny_checkpoint, inference):
    pytest.importorskip("openvino")
    with live_server(tiny_checkpoint, inference=inference, replicas=1, threads=1) as srv:
        info = httpx.get(srv.url + "/info").json()
        r = httpx.post(
            srv.url + "/score", json={"query": "drill", "titles": ["cordless drill", "area rug"]}, timeout=60
        )
    assert r.status_code == 200 and len(r.json()["results"]) == 2
    assert info["settings"]["inference"] == inference
    model = info["model"]
    if inference == "openvino":
        assert model["inference"] == "openvino" and model["inference_reason"] == "inference=openvino"
    else:  # the probe's choice and figures
        assert model["inference"] in ("torch", "openvino") and model["inference_reason"].startswith("auto: probe on")
        assert set(model["inference_probe"]) == {"torch_ms", "openvino_ms"}


@pytest.mark.parametrize("attention", ["torch", "fused"])
def test_attention_setting_reaches_the_model_processes(tiny_checkpoint, attention):
    """QTREL_ATTENTION picks the torch forward's attention kernel in every model process, and /info says which
    and why; scores are the same either way (tests/model/test_fused_attention.py checks them closely)."""
    import torch

    from model.engines import fused

    with live_server(tiny_checkpoint, attention=attention, replicas=1, threads=1) as srv:
        info = httpx.get(srv.url + "/info").json()
        r = httpx.post(srv.url + "/score", json={"query": "drill", "titles": ["cordless drill", "rug"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()["results"]) == 2
    assert info["settings"]["attention"] == attention
    model = info["model"]
    if attention == "torch":
        assert model["attention"] == "sdpa" and model["attention_reason"] == "asked for torch's kernels"
        assert model["attention_path"] is None and model["fused_norm"] is False  # none of the C code
    elif fused.available()[0]:
        assert model["attention"] == "fused" and model["attention_reason"] == "asked for the fused kernel"
        assert model["attention_path"] == fused.path(getattr(torch, model["dtype"]))
        assert model["fused_norm"] is True
    else:
        assert model["attention"] == "sdpa" and "fused kernel unavailable" in model["attention_reason"]
    assert model["attention_probe"] is None  # asked for: nothing probed


def test_dtype_int8_serves_the_checkpoints_static_int8_plan(tiny_checkpoint, tmp_path):
    """--dtype int8 with a plan beside the weights (qtrel quantize) runs OpenVINO's int8 kernels, and says so."""
    pytest.importorskip("openvino")
    import shutil

    from model.checkpoint import load_module
    from model.engines import int8
    from model.relevance import pad_batch

    ckpt = Path(shutil.copytree(tiny_checkpoint, tmp_path / "tiny"))
    ref = RelevanceModel.load(ckpt, dtype="float32")
    enc = ref.encode(read_pairs(64))
    batch = pad_batch(enc.input_ids, enc.token_type_ids, ref.tokenizer.pad_id)
    int8.Int8Plan(int8.calibrate(load_module(ckpt).eval(), [batch])).save(ckpt)
    with live_server(ckpt, dtype="int8", inference="auto", replicas=1, threads=1) as srv:
        model = httpx.get(srv.url + "/info").json()["model"]
        r = httpx.post(srv.url + "/score", json={"query": "drill", "titles": ["cordless drill", "rug"]}, timeout=60)
    assert r.status_code == 200 and [x["index"] for x in r.json()["results"]] == [0, 1]
    assert model["dtype"] == "int8" and model["inference"] == "openvino"
    assert "12 linears static int8" in model["inference_reason"]
