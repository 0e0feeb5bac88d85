"""The optional OpenVINO forward (model.engines.openvino): parity with the torch path, the head-mask and
bad-batch fallbacks to torch, the start-up probe, and torch alone where OpenVINO is absent or not asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.engines.openvino import MARGIN
from model.relevance import RelevanceModel
from tests.conftest import read_pairs

ROOT = Path(__file__).resolve().parents[2]


def pairs_batch(model: RelevanceModel, n: int, start: int = 0) -> tuple[list, list]:
    enc = model.encode(read_pairs(start + n)[start:])
    return enc.input_ids, enc.token_type_ids


def longest(model: RelevanceModel, n: int) -> tuple[list, list]:
    """n pairs of exactly max_length tokens (distinct ids, so that rows differ)."""
    T = model.max_length
    ids = [
        [model.tokenizer.cls_id] + [1000 + 7 * i + j for j in range(T - 2)] + [model.tokenizer.sep_id] for i in range(n)
    ]
    return ids, [[0] * (T // 2) + [1] * (T - T // 2)] * n


@pytest.fixture(scope="module")
def ov():
    return pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def torch32(tiny_checkpoint) -> RelevanceModel:
    return RelevanceModel.load(tiny_checkpoint, dtype="float32")


@pytest.fixture(scope="module")
def ov32(ov, tiny_checkpoint) -> RelevanceModel:
    m = RelevanceModel.load(tiny_checkpoint, dtype="float32")
    m.use_inference("openvino")
    assert m.inference == "openvino", m.inference_reason
    return m


@pytest.mark.parametrize("n,start", [(1, 0), (3, 5), (17, 9), (64, 0)])
def test_float32_openvino_logits_match_the_torch_path(ov32, torch32, n, start):
    ids, seg = pairs_batch(torch32, n, start)
    want = torch32.logits(ids, seg)
    got = ov32.logits(ids, seg)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 5])
def test_at_max_length_and_mixed_with_short_pairs(ov32, torch32, n):
    ids, seg = longest(torch32, n)
    short_ids, short_seg = pairs_batch(torch32, 6)
    ids, seg = ids + short_ids, seg + short_seg  # one batch: groups of similar length, scattered back in order
    torch.testing.assert_close(ov32.logits(ids, seg), torch32.logits(ids, seg), atol=1e-4, rtol=1e-4)


def test_bfloat16_openvino_stays_close_and_agrees_on_levels(ov, tiny_checkpoint):
    ref = RelevanceModel.load(tiny_checkpoint, dtype="float32")
    bf = RelevanceModel.load(tiny_checkpoint, dtype="bfloat16")
    bf.use_inference("openvino")
    assert bf.inference == "openvino", bf.inference_reason
    ids, seg = pairs_batch(ref, 128)
    want, got, torch_bf = (
        ref.logits(ids, seg),
        bf.logits(ids, seg),
        RelevanceModel.load(tiny_checkpoint, dtype="bfloat16").logits(ids, seg),
    )
    # bfloat16 keeps 8 mantissa bits: OpenVINO's error against float32 within a few times torch's own
    ov_err, torch_err = (got - want).abs().max().item(), (torch_bf - want).abs().max().item()
    assert ov_err < max(4 * torch_err, 0.05), (ov_err, torch_err)
    levels = (ref.score(got).level == ref.score(want).level).float().mean().item()
    assert levels >= 0.95, levels


def test_head_masks_run_on_torch(ov32, torch32):
    ids, seg = pairs_batch(torch32, 8)
    mask = torch.ones(torch32.cfg.num_hidden_layers, torch32.cfg.num_attention_heads)
    mask[0, 1] = 0
    assert torch.equal(ov32.logits(ids, seg, mask), torch32.logits(ids, seg, mask))  # the very torch path
    assert not torch.allclose(ov32.logits(ids, seg, mask), ov32.logits(ids, seg), atol=1e-6)


def test_a_batch_openvino_refuses_gets_torchs_answer(ov32, torch32):
    ids, seg = longest(torch32, 1)
    too_long = [ids[0][:-1] + [1000] * 4 + [ids[0][-1]]]  # past the position table
    with pytest.raises(IndexError):  # torch's error for this batch (the model process answers Error), not zeros
        ov32.logits(too_long, [seg[0] + [1] * 4])
    with pytest.raises(ValueError):  # an empty batch, likewise
        ov32.logits([], [])
    for bad_ids, bad_seg in (([101, 40000, 102], [0, 0, 0]), ([101, -3, 102], [0, 0, 0]), ([101, 7, 102], [0, 5, 0])):
        with pytest.raises(IndexError):  # an unknown token or segment id: OpenVINO would answer it
            ov32.logits([bad_ids], [bad_seg])


def test_auto_probes_both_and_reports_the_choice(ov, tiny_checkpoint):
    m = RelevanceModel.load(tiny_checkpoint, dtype="float32")
    m.use_inference("auto")
    d = m.describe()
    assert d["inference"] in ("torch", "openvino")
    assert d["inference_reason"].startswith("auto: probe on 32x") and "openvino" in d["inference_reason"]
    probe = d["inference_probe"]
    assert set(probe) == {"torch_ms", "openvino_ms"} and all(v > 0 for v in probe.values())
    faster = probe["torch_ms"] > MARGIN * probe["openvino_ms"]  # only a clear win switches engines
    assert d["inference"] == ("openvino" if faster else "torch")
    json.dumps(d)  # /info shows it as is
    m.use_inference("torch")  # and back: torch alone, nothing of OpenVINO kept
    assert m.describe()["inference"] == "torch" and m.describe()["inference_probe"] is None


def test_without_openvino_auto_and_openvino_run_torch_and_say_why(tiny_checkpoint, torch32, monkeypatch):
    monkeypatch.setitem(sys.modules, "openvino", None)  # as if not installed: `import openvino` raises ImportError
    m = RelevanceModel.load(tiny_checkpoint, dtype="float32")
    ids, seg = pairs_batch(m, 4)
    for choice in ("auto", "openvino"):
        m.use_inference(choice)
        assert m.inference == "torch"
        assert m.inference_reason.startswith("torch: openvino not importable ("), m.inference_reason
        assert torch.equal(m.logits(ids, seg), torch32.logits(ids, seg))


def test_openvino_is_not_asked_for_where_it_cannot_serve(tiny_checkpoint):
    int8 = RelevanceModel.load(tiny_checkpoint, dtype="int8")
    int8.use_inference("auto")
    reason = int8.inference_reason
    assert int8.inference == "torch" and ("int8" in reason or "not importable" in reason), reason
    with pytest.raises(ValueError, match="inference must be one of"):
        int8.use_inference("onnx")


TORCH_ONLY = r"""
import json, sys
from service.runtime.workers.backend import LoadSpec
from service.runtime.workers.runner import forward_batch, load_model, start_inference
spec = LoadSpec(sys.argv[1], threads=1, inference="torch")
model = load_model(spec)
start_inference(model, spec)
model.warm_up(256)
forward_batch(model, [([101, 2023, 2003, 102], [0, 0, 0, 0])])
loaded = [m for m in sys.modules if m.split(".")[0] == "openvino"]
print(json.dumps({"inference": model.describe()["inference"], "openvino": loaded}))
"""


def test_inference_torch_never_imports_openvino(tiny_checkpoint):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", TORCH_ONLY, str(tiny_checkpoint)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"inference": "torch", "openvino": []}
