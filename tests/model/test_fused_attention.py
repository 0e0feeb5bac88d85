"""The fused packed attention kernel (model/engines/_kernels.c through model.engines.fused): against a float64
reference per pair, on every ISA build this CPU can run; its refusals; and the model path that uses it."""

from __future__ import annotations

import platform
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from model.bert import BertForRelevance
from model.builtin import builtin_dir
from model.config import BertConfig
from model.device import cpu_flags
from model.engines import fused as fa
from model.engines import kernels as kernel_layer
from model.engines.packed import PackedBertForRelevance
from model.relevance import RelevanceModel
from tests.conftest import read_pairs

pytestmark = pytest.mark.skipif(not fa.available()[0], reason=f"fused attention not built: {fa.available()[1]}")


def reference(q, k, v, qs, ql, ks, kl, nh, hs, mask=None):
    """Per pair and head, softmax(q k^T / sqrt(hs)) v in float64: the context rows at q's rows."""
    out = {}
    for a, n, b, m in zip(qs, ql, ks, kl):
        qq = q[a : a + n, : nh * hs].double().view(n, nh, hs).transpose(0, 1)
        kk = k[b : b + m, : nh * hs].double().view(m, nh, hs).transpose(0, 1)
        vv = v[b : b + m, : nh * hs].double().view(m, nh, hs).transpose(0, 1)
        ctx = torch.softmax(qq @ kk.transpose(1, 2) * hs**-0.5, -1) @ vv  # (nh, n, hs)
        if mask is not None:
            ctx = ctx * mask.double().view(nh, 1, 1)
        for i in range(n):
            out[a + i] = ctx[:, i].reshape(-1)
    return out


def layout(lengths, seed=0):
    """A packed layout: pairs back to back, a few filler rows after (as a token bucket leaves)."""
    ln = np.array(lengths, dtype=np.int64)
    st = np.cumsum(ln) - ln
    return st, ln, int(ln.sum()) + 5


CASES = [  # lengths, heads, head size
    ([1], 1, 8),
    ([2, 1, 3], 2, 8),
    ([7, 8, 9, 15, 16, 17], 4, 8),
    ([33, 20, 14, 14, 40], 12, 32),
    ([128, 64, 3], 3, 64),
    ([512, 30], 2, 32),
    ([24, 11], 2, 40),  # a multiple of 8, not of 32: the kernel's 8-column tail
    ([19, 5, 26], 6, 16),
]


def check(lengths, nh, hs, dtype, lib=None, cls_only=False, mask=None, monkeypatch=None, threads=None):
    st, ln, n = layout(lengths)
    g = torch.Generator().manual_seed(len(lengths) * 131 + nh * 7 + hs)
    w = nh * hs
    qkv = (torch.randn(n, 3 * w + 4, generator=g) * 2).to(dtype)  # 4 extra columns: the slices are strided
    q, k, v = qkv[:, :w], qkv[:, w : 2 * w], qkv[:, 2 * w : 3 * w]
    qs, ql = st, ln
    if cls_only:  # one query per pair, from its own matrix (the last layer's [CLS] rows)
        q = q.index_select(0, torch.from_numpy(st)).contiguous()
        qs, ql = np.arange(len(ln)), np.ones(len(ln), np.int64)
    out = torch.full((len(q), w), 7.0, dtype=dtype)  # rows no pair names must keep this
    if lib is not None:
        monkeypatch.setattr(fa, "_library", lambda: (lib, ""))
    fa.packed_attention(q, k, v, out, fa.Rows(qs, ql, st, ln), nh, hs, mask, threads)
    want = reference(q.float(), k.float(), v.float(), qs, ql, st, ln, nh, hs, mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    named = set(want)
    for r in range(len(q)):
        if r in named:
            torch.testing.assert_close(out[r].double(), want[r], atol=tol, rtol=tol if dtype == torch.float32 else 1e-2)
        else:
            assert torch.all(out[r] == 7.0), f"row {r} belongs to no pair and was written"
    return out


@pytest.fixture(params=["float32", "bfloat16", "bfloat16-dot", "bfloat16-amx"])
def dtype(request):
    """float32; bfloat16 in float32 arithmetic; bfloat16 on AVX512-BF16's dot products; bfloat16 on AMX tiles
    (head sizes that are multiples of 32; the others on the dot products), each where the CPU has it."""
    if request.param == "float32":
        yield torch.float32
        return
    dot, amx = request.param != "bfloat16", request.param == "bfloat16-amx"
    if dot and not fa.bf16_dot(True):
        pytest.skip("no AVX512-BF16 on this CPU")
    if amx and not fa.amx(True):
        pytest.skip("no AMX-BF16 on this CPU")
    assert fa.bf16_dot(dot) == dot and fa.amx(amx) == amx
    try:
        yield torch.bfloat16
    finally:
        fa.bf16_dot(True)  # back to the defaults: on where the CPU can
        fa.amx(True)


@pytest.mark.parametrize("lengths, nh, hs", CASES + [([1, 2, 3, 5, 63, 64, 65], 2, 16)])
def test_matches_reference(lengths, nh, hs, dtype):
    check(lengths, nh, hs, dtype)


def test_amx_on_where_the_cpu_has_it():
    """The AMX path is the default exactly where the CPU has AMX-BF16 (and Linux grants the tile state), and can
    be turned off."""
    assert fa.amx() == ({"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags())
    try:
        assert fa.amx(False) is False
    finally:
        fa.amx(True)


def test_path_names_the_code_that_runs():
    """/info's `attention_path`: AMX tiles, the AVX512-BF16 dot products or float32 arithmetic, as toggled."""
    assert fa.path(torch.float32) == "float32 arithmetic"
    try:
        assert fa.path(torch.bfloat16).startswith("AMX") == fa.amx()
        fa.amx(False)
        assert fa.path(torch.bfloat16) == ("AVX512-BF16 dot products" if fa.bf16_dot() else "float32 arithmetic")
        fa.bf16_dot(False)
        assert fa.path(torch.bfloat16) == "float32 arithmetic"
    finally:
        fa.amx(True)
        fa.bf16_dot(True)


def test_bf16_dot_on_where_the_cpu_has_it():
    """The AVX512-BF16 path is the default exactly where the CPU has the instructions, and can be turned off."""
    assert fa.bf16_dot() == ({"avx512_bf16", "avx512vl", "avx512bw"} <= cpu_flags())
    try:
        assert fa.bf16_dot(False) is False
    finally:
        fa.bf16_dot(True)


def test_cls_rows_and_head_mask(dtype):
    """One query per pair (the [CLS]-only last layer) and a head mask that silences one head and halves
    another, as the head-analysis routes send."""
    mask = torch.tensor([1.0, 0.0, 0.5, 1.0])
    check([9, 31, 4, 17], 4, 32, dtype, cls_only=True, mask=mask)
    check([9, 31, 4, 17], 4, 32, dtype, mask=mask)


def test_threads_split_the_work_bit_for_bit(dtype):
    """On several of torch's OpenMP threads the (pair, head) units are split by work; each is computed as on
    one thread, so every thread count gives the same bits, more threads than units included."""
    assert fa.parallel()  # torch's CPU wheels run OpenMP: the kernel must find it
    mask = torch.tensor([1.0, 0.0, 0.5, 1.0])
    for lengths, nh, hs in CASES + [([9, 31, 4, 17], 4, 32)]:
        one = check(lengths, nh, hs, dtype, threads=1)
        for t in (2, 3, 8, 300):
            assert torch.equal(check(lengths, nh, hs, dtype, threads=t), one), (lengths, t)
    one = check([9, 31, 4, 17], 4, 32, dtype, cls_only=True, mask=mask, threads=1)
    assert torch.equal(check([9, 31, 4, 17], 4, 32, dtype, cls_only=True, mask=mask, threads=2), one)


def test_without_openmp_one_thread(tmp_path, monkeypatch):
    """A library not handed an OpenMP runtime (torch threading otherwise) runs any `threads` on the caller's."""
    so = tmp_path / "attention-serial.so"
    shutil.copy(fa._library()[0]._name, so)  # another file: its own copy of the library's state
    lib = fa.bind(so, openmp=False)
    one = check([33, 20, 14, 14, 40], 12, 32, torch.float32, lib=lib, monkeypatch=monkeypatch, threads=1)
    assert torch.equal(check([33, 20, 14, 14, 40], 12, 32, torch.float32, lib=lib, monkeypatch=monkeypatch,
                             threads=4), one)  # fmt: skip


def isa_builds():
    """(name, -march) for the builds of one ISA each that this CPU can run: the baseline always."""
    flags = cpu_flags()
    out = [("baseline", "x86-64")]
    if {"avx2", "fma"} <= flags:
        out.append(("avx2", "x86-64-v3"))
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        out.append(("avx512", "x86-64-v4"))
    return out


@pytest.mark.skipif(shutil.which("cc") is None or platform.machine() != "x86_64", reason="x86-64 builds need cc")
@pytest.mark.parametrize("name, march", isa_builds())
def test_every_isa_build_matches_reference(name, march, tmp_path, monkeypatch):
    """The installed library picks its AVX-512, AVX2 or baseline code by the CPU; each of the three, built
    alone, must agree with the reference, so the code a user on another CPU runs is tested here too."""
    src = fa._HERE / "_kernels.c"
    if not src.exists():
        pytest.skip("the kernel's source is not beside the installed package")
    so = tmp_path / f"attention-{name}.so"
    flags = ["-O3", "-Wall", "-Werror", "-shared", "-fPIC", "-Wno-psabi", f"-march={march}", "-DQTREL_NO_CLONES"]
    subprocess.run(["cc", *flags, "-o", str(so), str(src)], check=True)
    lib = fa.bind(so)
    dots = [0, 1] if lib.qtrel_bf16_dot(1) else [0]
    modes = (
        [(torch.float32, 0, 0)] + [(torch.bfloat16, d, 0) for d in dots] + [(torch.bfloat16, 1, 1)] * lib.qtrel_amx(1)
    )
    for dtype, dot, amx in modes:
        lib.qtrel_bf16_dot(dot)
        lib.qtrel_amx(amx)
        check([33, 20, 14, 14, 40], 12, 32, dtype, lib=lib, monkeypatch=monkeypatch)
        check([24, 11, 1], 2, 40, dtype, lib=lib, monkeypatch=monkeypatch)
        check([9, 31, 4, 17], 4, 32, dtype, lib=lib, cls_only=True, mask=torch.tensor([1.0, 0.0, 0.5, 1.0]),
              monkeypatch=monkeypatch)  # fmt: skip
        check([33, 20, 14, 14, 40], 12, 32, dtype, lib=lib, monkeypatch=monkeypatch, threads=3)


def test_refuses_what_it_cannot_compute():
    """Every bound the C side trusts is checked first: a bad call is a ValueError, never a crash."""
    st, ln = np.array([0, 5]), np.array([5, 3])
    x = torch.randn(8, 3 * 64)
    q, k, v = x[:, :64], x[:, 64:128], x[:, 128:]
    out = torch.empty(8, 64)
    with pytest.raises(ValueError, match="outside"):
        fa.packed_attention(q, k, v, out, fa.Rows(st, ln, st, np.array([5, 4])), 2, 32)
    with pytest.raises(ValueError, match="outside"):
        fa.packed_attention(q, k, v, out, fa.Rows(np.array([-1, 5]), ln, st, ln), 2, 32)
    with pytest.raises(ValueError, match="one entry per pair"):
        fa.packed_attention(q, k, v, out, fa.Rows(st, ln[:1], st, ln), 2, 32)
    with pytest.raises(ValueError, match="unsupported"):
        fa.packed_attention(q.half(), k.half(), v.half(), out.half(), fa.Rows(st, ln, st, ln), 2, 32)
    with pytest.raises(ValueError, match="unsupported"):
        fa.packed_attention(q, k, v, out, fa.Rows(st, ln, st, ln), 3, 20)  # head size 20: not a multiple of 8
    with pytest.raises(ValueError, match="unit-stride"):
        fa.packed_attention(q, k, v.t().contiguous().t(), out, fa.Rows(st, ln, st, ln), 2, 32)
    with pytest.raises(ValueError, match="at least 96"):
        fa.packed_attention(q, k, v, out, fa.Rows(st, ln, st, ln), 3, 32)  # 3 heads of 32 do not fit in 64 columns
    with pytest.raises(ValueError, match="head_mask"):
        fa.packed_attention(q, k, v, out, fa.Rows(st, ln, st, ln), 2, 32, torch.ones(3))
    with pytest.raises(ValueError, match="as many rows"):
        fa.packed_attention(q, k, v, torch.empty(7, 64), fa.Rows(st, ln, st, ln), 2, 32)
    huge = np.array([2**62, 2**62])  # start + length wraps in int64: must not pass as in bounds
    with pytest.raises(ValueError, match="outside"):
        fa.packed_attention(q, k, v, out, fa.Rows(huge, huge, st, ln), 2, 32)
    with pytest.raises(ValueError, match="no key"):  # its query rows would be left unwritten
        fa.packed_attention(q, k, v, out, fa.Rows(st, ln, st, np.array([5, 0])), 2, 32)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_as_torch(bad, dtype):
    """A NaN or infinite key gives what torch's softmax gives (NaN where a score is NaN or +inf, a zero weight
    where it is -inf), not a finite answer built on it; the other pair is unaffected."""
    st, ln = np.array([0, 4]), np.array([4, 3])
    x = torch.randn(7, 3 * 32, generator=torch.Generator().manual_seed(5))
    x[1, 32] = bad  # a key of pair 0
    x = x.to(dtype)
    q, k, v = x[:, :32], x[:, 32:64], x[:, 64:]
    out = fa.packed_attention(q, k, v, torch.empty(7, 32, dtype=dtype), fa.Rows(st, ln, st, ln), 1, 32)
    want = reference(q.float(), k.float(), v.float(), st, ln, st, ln, 1, 32)
    assert torch.isnan(out[:4]).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r in range(7):
        torch.testing.assert_close(out[r].double(), want[r], atol=tol, rtol=tol, equal_nan=True)


def test_releases_the_gil():
    """The forward workers run batches on threads: the kernel must not hold the GIL while it works. A thread
    counts while one long call runs: it must count at a good part of its free rate (holding the GIL, the
    call would leave it only the Python around the call: ~4% of that rate, measured with ctypes.PyDLL; released,
    ~100%)."""
    st, ln, n = layout([512] * 16)
    x = torch.randn(n, 3 * 384)
    q, k, v = x[:, :384], x[:, 384:768], x[:, 768:]
    out = torch.empty(n, 384)
    ticks = [0]
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1

    t = threading.Thread(target=tick)
    t.start()
    try:
        while ticks[0] == 0:
            pass
        before, t0 = ticks[0], time.perf_counter()
        time.sleep(0.1)  # the main thread asleep: the counter's free rate
        rate = (ticks[0] - before) / (time.perf_counter() - t0)
        before, t0 = ticks[0], time.perf_counter()
        fa.packed_attention(q, k, v, out, fa.Rows(st, ln, st, ln), 12, 32)
        during, elapsed = ticks[0] - before, time.perf_counter() - t0
    finally:
        stop.set()
        t.join()
    assert during > 0.15 * rate * elapsed, (during, rate, elapsed)


# --- the model path ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoded(unpacked):
    """16 English and 8 Chinese pairs of differing lengths."""
    return unpacked.encode(read_pairs(16) + read_pairs(8, "qbqtc"))


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 0.08)])
def test_model_kernels_agree(tiny_checkpoint, unpacked, encoded, dtype, atol, monkeypatch):
    """The packed forward with the fused kernel gives the padded reference's logits, with and without a head
    mask; at 2 torch threads too, on torch's OpenMP team."""
    m = RelevanceModel.load(tiny_checkpoint, dtype=dtype)
    mask = torch.ones(2, 4)
    mask[1, 0] = 0
    m.use_attention("fused")
    assert m.describe()["attention"] == "fused"
    calls = count_calls(monkeypatch)
    want = {}
    for name, head_mask in (("plain", None), ("masked", mask)):
        want[name] = unpacked.logits(encoded.input_ids, encoded.token_type_ids, head_mask)
        got = m.logits(encoded.input_ids, encoded.token_type_ids, head_mask)
        torch.testing.assert_close(got, want[name], atol=atol, rtol=0)
    assert calls == [2, 2]  # per forward: one per layer, the last at [CLS] only
    calls.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = m.logits(encoded.input_ids, encoded.token_type_ids)
        torch.testing.assert_close(got, want["plain"], atol=atol, rtol=0)
    finally:
        torch.set_num_threads(threads)
    assert calls == [2]  # two threads: still fused


def test_long_pairs_go_to_the_per_group_kernel(tiny_checkpoint, unpacked, encoded, monkeypatch):
    """The pairs over a layer's `fused_max` (where torch's kernel measured faster) attend per group and the rest of
    their batch stays fused, in every layer, the last one ([CLS] only) included: the reference's logits
    whatever the split, with and without a head mask."""
    import model.engines.packed as packed

    m = RelevanceModel.load(tiny_checkpoint)
    m.use_attention("fused")
    lengths = sorted(len(x) for x in encoded.input_ids)
    mask = torch.ones(2, 4)
    mask[1, 0] = 0
    want = {i: unpacked.logits(encoded.input_ids, encoded.token_type_ids, hm) for i, hm in enumerate((None, mask))}
    fused_pairs: list[int] = []
    grouped_pairs: list[int] = []
    real_fused, real_attend = packed.packed_attention, packed.PackedSelfAttention._attend
    for limit in (lengths[-1], lengths[-2], lengths[len(lengths) // 2], lengths[0] - 1):
        long = sum(n > limit for n in lengths)
        for layer in m.module.bert.blocks:
            monkeypatch.setattr(layer.attn, "fused_max", limit)
        monkeypatch.setattr(
            packed, "packed_attention", lambda *a, **k: fused_pairs.append(a[4].n) or real_fused(*a, **k)
        )
        monkeypatch.setattr(
            packed.PackedSelfAttention,
            "_attend",
            lambda s, q, *a: grouped_pairs.append(q.shape[0]) or real_attend(s, q, *a),
        )
        for i, hm in enumerate((None, mask)):
            fused_pairs.clear(), grouped_pairs.clear()
            got = m.logits(encoded.input_ids, encoded.token_type_ids, hm)
            torch.testing.assert_close(got, want[i], atol=1e-5, rtol=0)
            assert fused_pairs == ([len(lengths) - long] * 2 if long < len(lengths) else []), limit
            assert sum(grouped_pairs) == 2 * long, limit  # each layer attends every long pair once
        monkeypatch.undo()


def count_calls(monkeypatch) -> list[int]:
    """Fused kernel calls per forward, recorded while the test runs (so a test sees the kernel really ran)."""
    import model.engines.packed as packed

    calls: list[int] = []
    real = packed.packed_attention

    def counted(*a, **k):
        calls[-1] += 1
        return real(*a, **k)

    real_forward = packed.PackedEncoder.forward_packed

    def forward(self, *a, **k):
        calls.append(0)
        return real_forward(self, *a, **k)

    monkeypatch.setattr(packed, "packed_attention", counted)
    monkeypatch.setattr(packed.PackedEncoder, "forward_packed", forward)
    return calls


def test_fused_max_tokens_per_path(tiny_checkpoint, monkeypatch):
    """Every pair fused where bfloat16 runs on AMX tiles (head sizes that are multiples of 32) or on the
    AVX512-BF16 path without AMX (each measured faster than torch's kernels at every length); with AMX but
    not its tile path, with the dot path off and in float32, pairs up to FUSED_MAX_TOKENS; each layer gets the
    bound of its model's precision and head size when the kernel is set."""
    import model.engines.packed as packed

    everything, amx_flags = 2**62, {"avx512_bf16", "amx_bf16"}
    for flags, dot, amx, dtype, hs, want in (
        ({"avx512_bf16"}, True, False, torch.bfloat16, 32, everything),
        (amx_flags, True, True, torch.bfloat16, 32, everything),
        (amx_flags, True, True, torch.bfloat16, 64, everything),
        (amx_flags, True, True, torch.bfloat16, 16, packed.FUSED_MAX_TOKENS),  # the dot path, on an AMX CPU
        (amx_flags, True, False, torch.bfloat16, 32, packed.FUSED_MAX_TOKENS),
        ({"avx512_bf16"}, False, False, torch.bfloat16, 32, packed.FUSED_MAX_TOKENS),
        ({"avx512_bf16"}, True, False, torch.float32, 32, packed.FUSED_MAX_TOKENS),
        (amx_flags, True, True, torch.float32, 32, packed.FUSED_MAX_TOKENS),
    ):
        monkeypatch.setattr(kernel_layer, "cpu_flags", lambda f=flags: frozenset(f))
        monkeypatch.setattr(kernel_layer.fused, "bf16_dot", lambda d=dot: d)
        monkeypatch.setattr(kernel_layer.fused, "amx", lambda a=amx: a)
        assert kernel_layer.fused_max_tokens(dtype, hs) == want, (flags, dot, amx, dtype, hs)
    m = RelevanceModel.load(tiny_checkpoint, dtype="bfloat16")
    m.use_attention("fused")
    hs = {layer.attn.head_size for layer in m.module.bert.blocks}
    assert {layer.attn.fused_max for layer in m.module.bert.blocks} == {
        kernel_layer.fused_max_tokens(torch.bfloat16, h) for h in hs
    }
    monkeypatch.undo()
    m = RelevanceModel.load(tiny_checkpoint, dtype="float32")
    m.use_attention("fused")
    assert {layer.attn.fused_max for layer in m.module.bert.blocks} == {packed.FUSED_MAX_TOKENS}


def test_pruned_layers(monkeypatch):
    """Layers with different head counts (pruning) each call the kernel with their own."""
    cfg = BertConfig(vocab_size=50, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=64, pruned_heads={0: [1, 3], 2: [0]})  # fmt: skip
    module = PackedBertForRelevance(BertForRelevance(cfg))
    module.init_weights(seed=3)
    module.eval()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 50, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 1)]
    seg = [[0] * len(x) for x in ids]
    with torch.inference_mode():
        kernel_layer.set_attention(module, "sdpa")
        want = module.forward_packed(ids, seg)
        kernel_layer.set_attention(module, "fused")
        calls = count_calls(monkeypatch)
        got = module.forward_packed(ids, seg)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert calls == [3]


def test_choice_probe_and_fallback(tiny_checkpoint, monkeypatch):
    """Where the library is built, the start-up probe times both kernels and the faster serves (both figures in
    /info's model block), unless a kernel is asked for; where it is not, the per-group kernel serves, and /info
    and forcing "fused" say why."""
    m = RelevanceModel.load(tiny_checkpoint)
    d = m.describe()
    probe = d["attention_probe"]
    assert set(probe) == {"sdpa", "fused"} and all(v > 0 for v in probe.values())
    assert d["attention"] == ("fused" if probe["fused"] * kernel_layer.PROBE_MARGIN < probe["sdpa"] else "sdpa")
    assert d["attention_reason"].startswith("auto: probe on 32 pairs")
    forced = RelevanceModel.load(tiny_checkpoint, attention="fused").describe()
    assert (forced["attention"], forced["attention_probe"]) == ("fused", None)
    plain = RelevanceModel.load(tiny_checkpoint, attention="torch").describe()
    assert (plain["attention"], plain["attention_probe"]) == ("sdpa", None)
    with pytest.raises(ValueError, match="auto, fused or torch"):
        RelevanceModel.load(tiny_checkpoint, attention="flash")

    monkeypatch.setattr(fa, "_library", lambda: (None, "not built (no C compiler at install?)"))
    for want in ("auto", "fused"):
        m = RelevanceModel.load(tiny_checkpoint, attention=want)
        d = m.describe()
        assert d["attention"] == "sdpa" and d["attention_probe"] is None
        assert d["attention_reason"] == f"{want}: fused kernel unavailable (not built (no C compiler at install?))"
    with pytest.raises(ValueError, match="no C compiler"):
        m.use_attention("fused")


def test_probe_times_only_what_the_kernels_differ_in(tiny_checkpoint, monkeypatch):
    """The probe runs the projections once, outside the timing, and never the output layer: those are the same
    for both kernels, and their noise once outweighed the difference. Each kernel's context is timed and the
    layer's kernels and torch's threads are put back."""
    m = RelevanceModel.load(tiny_checkpoint, attention="torch")
    attn = m.module.bert.layers[0].attn
    seen = {"project": 0, "context": []}
    real_project, real_context = attn._project, attn.context_packed

    def project(x):
        seen["project"] += 1
        return real_project(x)

    def context(qkv, p, head_mask):
        seen["context"].append(attn.kernel)
        return real_context(qkv, p, head_mask)

    class Out(torch.nn.Module):
        def forward(self, _):
            raise AssertionError("the probe ran the output layer")

    monkeypatch.setattr(attn, "_project", project)
    monkeypatch.setattr(attn, "context_packed", context)
    monkeypatch.setattr(attn, "out", Out())
    threads = torch.get_num_threads()
    figures = kernel_layer.attention_probe(m.module, rounds=3)
    assert set(figures) == {"sdpa", "fused"} and all(v > 0 for v in figures.values())
    assert seen == {"project": 1, "context": ["sdpa", "fused"] * 4}
    assert (attn.kernel, attn.grouped, torch.get_num_threads()) == ("sdpa", "sdpa", threads)


@pytest.mark.slow
def test_default_model_levels_unchanged():
    """The real MiniLM on real dev pairs: the fused kernel keeps float32's logits to 1e-5 and every level."""
    m = RelevanceModel.load(builtin_dir("default"), dtype="float32")
    enc = m.encode(read_pairs(256))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for kind in ("sdpa", "fused"):
            m.use_attention(kind)
            out[kind] = torch.cat(
                [m.logits(enc.input_ids[i : i + 32], enc.token_type_ids[i : i + 32]) for i in range(0, 256, 32)]
            )
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out["fused"], out["sdpa"], atol=1e-5, rtol=0)
    assert torch.equal(out["fused"].argmax(-1), out["sdpa"].argmax(-1))
