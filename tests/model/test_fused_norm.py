"""The fused residual add + LayerNorm (model/engines/_kernels.c's qtrel_add_layer_norm,
model.engines.fused.add_layer_norm) against float64 arithmetic, in every ISA build, on several threads, and inside
the packed forward."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch
from torch import nn

from model.bert import Layer
from model.engines import fused as fa
from model.relevance import RelevanceModel
from tests.conftest import read_pairs
from tests.model.test_fused_attention import isa_builds

pytestmark = pytest.mark.skipif(not fa.available()[0], reason="the fused kernels are not built")


def norm_of(width: int, dtype: torch.dtype, seed: int = 0) -> nn.LayerNorm:
    g = torch.Generator().manual_seed(seed)
    norm = nn.LayerNorm(width, eps=1e-12)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(width, generator=g))
        norm.bias.copy_(0.3 * torch.randn(width, generator=g))
    return norm.to(dtype)


def inputs(rows: int, width: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3 + 1  # an offset mean, as a residual stream has
    r = torch.randn(rows, width, generator=g)
    return x.to(dtype), r.to(dtype)


def want(x: torch.Tensor, r: torch.Tensor, norm: nn.LayerNorm) -> torch.Tensor:
    """The float64 answer on the same (rounded) inputs, the sum unrounded as the kernel keeps it."""
    s = x.double() + r.double()
    y = (s - s.mean(-1, keepdim=True)) / torch.sqrt(s.var(-1, unbiased=False, keepdim=True) + norm.eps)
    return y * norm.weight.double() + norm.bias.double()


TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # bfloat16: one rounding of the output


def check(rows: int, width: int, dtype: torch.dtype, lib=None, monkeypatch=None, threads=None) -> torch.Tensor:
    if lib is not None:
        monkeypatch.setattr(fa, "_library", lambda: (lib, ""))
    norm = norm_of(width, dtype)
    x, r = inputs(rows, width, dtype)
    got = fa.add_layer_norm(x, r, norm, torch.empty_like(x), threads=threads)
    torch.testing.assert_close(got.double(), want(x, r, norm), atol=TOL[dtype], rtol=TOL[dtype])
    return got


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("rows, width", [(1, 8), (7, 40), (300, 384), (5, 1024)])
def test_matches_float64(rows, width, dtype):
    check(rows, width, dtype)


def test_close_to_torchs_add_then_norm(dtype):
    """Against torch's two ops: equal in float32 to rounding, and within one bfloat16 step of the output where
    torch rounds the sum first."""
    norm = norm_of(384, dtype)
    x, r = inputs(200, 384, dtype)
    got = fa.add_layer_norm(x, r, norm, torch.empty_like(x))
    tol = 1e-5 if dtype == torch.float32 else 4e-2
    torch.testing.assert_close(got.float(), norm(x + r).float(), atol=tol, rtol=tol)


def test_out_may_be_either_input(dtype):
    norm = norm_of(64, dtype)
    x, r = inputs(33, 64, dtype)
    apart = fa.add_layer_norm(x, r, norm, torch.empty_like(x))
    assert torch.equal(fa.add_layer_norm(x, r.clone(), norm, r.clone()), apart)
    x2 = x.clone()
    assert torch.equal(fa.add_layer_norm(x2, r, norm, x2), apart) and torch.equal(x2, apart)


def test_strided_rows(dtype):
    """Rows of a wider matrix (a column slice), as a view of a projection would be."""
    norm = norm_of(48, dtype)
    x, r = inputs(9, 96, dtype)
    out = torch.empty(9, 48, dtype=dtype)
    got = fa.add_layer_norm(x[:, 48:], r[:, :48], norm, out)
    torch.testing.assert_close(got.double(), want(x[:, 48:], r[:, :48], norm), atol=TOL[dtype], rtol=TOL[dtype])


def test_both_widths_of_code(dtype, monkeypatch):
    """The 16-lane code (AVX512-BF16 CPUs) and the 8-lane clones each match float64, on rows whose width is a
    multiple of 16 (where the 16-lane code runs) and on one that is not."""
    lib = fa._library()[0]
    flag = ctypes.c_int.in_dll(lib, "qtrel_norm16")
    try:
        for wide in (1, 0):
            flag.value = wide
            check(300, 384, dtype)
            check(3, 1024, dtype)
            check(4, 80, dtype)  # 16-lane, with a tail past the 64s
            check(5, 40, dtype)
    finally:
        flag.value = 1


def test_threads_bit_for_bit(dtype):
    one = check(301, 384, dtype, threads=1)
    for t in (2, 3, 400):
        assert torch.equal(check(301, 384, dtype, threads=t), one), t


def test_non_finite_rows_stay_in_their_row(dtype):
    norm = norm_of(16, dtype)
    x, r = inputs(3, 16, dtype)
    x[1, 4] = float("nan")
    got = fa.add_layer_norm(x, r, norm, torch.empty_like(x))
    assert torch.isnan(got[1]).all() and torch.isfinite(got[[0, 2]]).all()


def test_refuses_what_it_cannot_compute():
    """A bad call is a ValueError, never a crash: the C side trusts every shape."""
    x, r = inputs(4, 40, torch.float32)
    norm = norm_of(40, torch.float32)
    with pytest.raises(ValueError, match="unsupported"):
        fa.add_layer_norm(x[:, :36], r[:, :36], norm_of(36, torch.float32), torch.empty(4, 36))  # not a multiple of 8
    with pytest.raises(ValueError, match="unsupported"):
        fa.add_layer_norm(x.bfloat16(), r.bfloat16(), norm, torch.empty(4, 40, dtype=torch.bfloat16))  # norm float32
    with pytest.raises(ValueError, match="unsupported"):
        fa.add_layer_norm(x, r, nn.LayerNorm(40, elementwise_affine=False), torch.empty_like(x))
    with pytest.raises(ValueError, match="unsupported"):
        fa.add_layer_norm(x.half(), r.half(), norm_of(40, torch.half), torch.empty_like(x).half())
    with pytest.raises(ValueError, match="same rows"):
        fa.add_layer_norm(x, r[:3], norm, torch.empty_like(x))
    with pytest.raises(ValueError, match="same rows"):
        fa.add_layer_norm(torch.randn(4, 48), torch.randn(4, 48), norm, torch.empty(4, 48))  # wider than the norm
    with pytest.raises(ValueError, match="unit-stride"):
        fa.add_layer_norm(x.t().contiguous().t(), r, norm, torch.empty_like(x))
    with pytest.raises(ValueError, match="unsupported"):
        fa.add_layer_norm(x, r.double(), norm, torch.empty_like(x))


@pytest.mark.skipif(shutil.which("cc") is None or platform.machine() != "x86_64", reason="x86-64 builds need cc")
@pytest.mark.parametrize("name, march", isa_builds())
def test_every_isa_build_matches(name, march, tmp_path, monkeypatch):
    """The AVX-512, AVX2 and baseline code, each built alone: what a user on another CPU runs."""
    src = fa._HERE / "_kernels.c"
    if not src.exists():
        pytest.skip("the kernel's source is not beside the installed package")
    so = tmp_path / f"norm-{name}.so"
    flags = ["-O3", "-Wall", "-Werror", "-shared", "-fPIC", "-Wno-psabi", f"-march={march}", "-DQTREL_NO_CLONES"]
    subprocess.run(["cc", *flags, "-o", str(so), str(src), "-lm"], check=True)
    lib = fa.bind(so)
    for wide in (1, 0):  # the 16-lane code where this CPU has AVX512-BF16, and this build's 8-lane code
        ctypes.c_int.in_dll(lib, "qtrel_norm16").value = wide
        for dt in (torch.float32, torch.bfloat16):
            check(300, 384, dt, lib=lib, monkeypatch=monkeypatch)
            check(7, 40, dt, lib=lib, monkeypatch=monkeypatch, threads=2)


# --- the model path ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt, atol", [("float32", 1e-5), ("bfloat16", 0.08)])
def test_packed_forward_with_and_without(tiny_checkpoint, unpacked, dt, atol, monkeypatch):
    """The packed forward uses it in every layer where it can, and gives the padded reference's logits; off,
    torch's two ops serve; /info says which."""
    encoded = unpacked.encode(read_pairs(16) + read_pairs(8, "qbqtc"))
    m = RelevanceModel.load(tiny_checkpoint, dtype=dt)
    layers = [x for x in m.module.modules() if isinstance(x, Layer)]
    assert m.describe()["fused_norm"] is True and all(x.fused_norm for x in layers)
    calls = []
    real = fa.add_layer_norm
    monkeypatch.setattr(fa, "add_layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref = unpacked.logits(encoded.input_ids, encoded.token_type_ids)
    on = m.logits(encoded.input_ids, encoded.token_type_ids)
    assert len(calls) == 2 * len(layers)  # two per layer, the [CLS]-only last one included
    for x in layers:
        x.fused_norm = False
    off = m.logits(encoded.input_ids, encoded.token_type_ids)
    assert len(calls) == 2 * len(layers)
    torch.testing.assert_close(on, ref, atol=atol, rtol=0)
    torch.testing.assert_close(off, ref, atol=atol, rtol=0)


def test_not_under_autograd(tiny_checkpoint):
    """With gradients on, torch's ops run (autograd cannot follow the kernel) and the gradient is there."""
    m = RelevanceModel.load(tiny_checkpoint, dtype="float32")
    layer = next(x for x in m.module.modules() if isinstance(x, Layer))
    assert layer.fused_norm
    x = torch.randn(5, layer.attn_norm.normalized_shape[0], requires_grad=True)
    r = torch.randn_like(x)
    with torch.enable_grad():
        fa.add_norm(layer.attn_norm, x, r, layer.fused_norm).sum().backward()
    assert x.grad is not None


def test_attention_torch_keeps_the_c_code_off(tiny_checkpoint):
    """attention="torch", the operator's switch off the C library, turns the fused norms off too."""
    m = RelevanceModel.load(tiny_checkpoint, dtype="float32", attention="torch")
    assert m.describe()["fused_norm"] is False
    assert not any(x.fused_norm for x in m.module.modules() if isinstance(x, Layer))
