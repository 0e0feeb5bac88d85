"""The paths a user on an older CPU gets, exercised on this one: the kernel, device and parity tests
again in a fresh process with oneDNN capped to AVX2 (`ONEDNN_MAX_CPU_ISA`, read once when oneDNN starts,
hence the subprocess) and ATen's kernels capped to AVX2 (`ATEN_CPU_CAPABILITY`). There bfloat16 has no
instructions: `dtype=auto` must pick float32, the bfloat16 probe must refuse the oneDNN layers, and the
float32 oneDNN layers (AVX2 kernels) must still match the plain ones and the reference.

The tests below `test_capped_paths_pass_in_a_fresh_process` run only inside that capped process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.device import bf16_capped, resolve_dtype
from model.engines.kernels import onednn_pays
from model.engines.onednn import probe
from model.relevance import RelevanceModel, pad_batch
from tests.conftest import read_pairs

ROOT = Path(__file__).resolve().parents[2]
CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# What runs again under the cap: the oneDNN linears against the plain layers and the probe's fallback,
# dtype resolution, and this file's parity with transformers on the real MiniLM.
CAPPED_TESTS = ["tests/model/test_kernels.py", "tests/model/test_device.py", "tests/model/test_isa_cap.py"]
capped = pytest.mark.skipif(
    os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() != "AVX2", reason="runs inside the AVX2-capped subprocess"
)


@pytest.mark.skipif(bool(os.environ.get("ONEDNN_MAX_CPU_ISA")), reason="already capped: this is the subprocess")
def test_capped_paths_pass_in_a_fresh_process():
    env = {**os.environ, **CAP, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *CAPPED_TESTS]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail


@capped
def test_auto_is_float32_under_the_cap():
    assert bf16_capped() == "ONEDNN_MAX_CPU_ISA=AVX2"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")


@capped
def test_onednn_keeps_float32_and_refuses_bfloat16_under_the_cap(tiny_checkpoint):
    assert probe(torch.float32) is None
    bf16 = probe(torch.bfloat16)
    assert bf16 is not None and bf16.startswith("RuntimeError: "), bf16
    model = RelevanceModel.load(tiny_checkpoint, dtype="auto")
    # oneDNN's float32 layers where the CPU has AVX-512 (the cap binds oneDNN, not MKL), else the fused plain
    # ones; tests/model/test_kernels.py, run under the cap too, exercises oneDNN's AVX2 kernels either way
    want = "onednn-packed" if onednn_pays(torch.float32) else "fused"
    assert model.dtype == "float32" and model.describe()["cpu_kernels"] == want
    low = RelevanceModel.load(tiny_checkpoint, dtype="bfloat16")  # asked for explicitly: plain layers, emulated
    assert low.describe()["cpu_kernels"] == f"plain (probe failed: {bf16})"
    # the per-group kernel is flash here (emulated bf16); the fused one serves where its start-up probe won
    assert {model.describe()["attention"], low.describe()["attention"]} <= {"sdpa", "fused"}


@capped
@pytest.mark.slow
def test_default_forward_matches_reference_under_the_cap():
    """The real MiniLM (the shipped default model) on the service's path (oneDNN float32 AVX2 kernels,
    no padding) against transformers on the same ids: logits to 1e-4, the same level on every pair."""
    transformers = pytest.importorskip("transformers")
    from model.builtin import builtin_dir

    path = builtin_dir("default")
    ours = RelevanceModel.load(path, dtype="auto")
    assert ours.dtype == "float32" and ours.cpu_kernels in ("onednn-packed", "fused") and ours.unpadded
    ref = transformers.BertForSequenceClassification.from_pretrained(
        path, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    enc = ours.encode(read_pairs(48))
    ids, seg, mask = pad_batch(enc.input_ids, enc.token_type_ids)
    with torch.inference_mode():
        want = ref(input_ids=ids, token_type_ids=seg, attention_mask=mask).logits
    got = ours.logits(enc.input_ids, enc.token_type_ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert torch.equal(ours.score(got).level, ours.score(want).level)
