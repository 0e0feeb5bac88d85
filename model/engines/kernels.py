"""The CPU kernel layer: the encoder's linear layers swapped for oneDNN ones with pre-packed weights
(`model.engines.onednn`, where its probe passes and where they pay, `onednn_pays`), or for fused plain ones, and
their kernels built for every token bucket at warm-up."""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch
from torch import nn

from model.bert import BertForRelevance
from model.device import cpu_flags, cpu_runs_bf16_natively
from model.engines import fused
from model.engines.onednn import OneDNNLinear, onednn_available, probe
from model.engines.packed import FUSED_MAX_TOKENS, PackedLayer
from model.packing import pack, token_buckets

log = logging.getLogger("qtrel.model")

__all__ = [
    "OneDNNLinear",
    "attention_path",
    "attention_probe",
    "choose_attention",
    "fused_max_tokens",
    "fused_unavailable",
    "install_cpu_kernels",
    "math_attention_pays",
    "onednn_available",
    "onednn_pays",
    "per_group_attention",
    "probe",
    "set_attention",
    "use_fused_linears",
    "use_fused_norms",
    "use_onednn_linears",
    "warm_linear_shapes",
]


def onednn_pays(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linears beat torch's default ones in `dtype` on this CPU. bfloat16: always
    (torch's default bf16 matmul is far slower). float32: on AVX-512 CPUs; with AVX2 only, MKL's sgemm behind
    nn.Linear ran 12-18% faster than oneDNN's packed float32 kernels on MiniLM's shapes (AMD EPYC Zen 3,
    docs/benchmarks.md), so the plain layers, fused, serve there."""
    return dtype != torch.float32 or "avx512f" in cpu_flags()


def math_attention_pays(dtype: torch.dtype) -> bool:
    """Whether the packed forward's attention runs faster as plain matmuls than in torch's flash kernel:
    native bfloat16 without AMX (1.01-1.07x the whole forward on a Zen 4 with AVX512-BF16). With AMX
    (Sapphire Rapids) it was 0.93-1.02x, so flash stays there, as in float32 and emulated bfloat16
    (docs/benchmarks.md)."""
    return dtype == torch.bfloat16 and cpu_runs_bf16_natively() and "amx_bf16" not in cpu_flags()


ATTENTION_KINDS = ("sdpa", "math", "fused")


def set_attention(module: nn.Module, kind: str) -> str:
    """Set the packed forward's attention kernel of every layer: "sdpa" (torch's flash kernel, per group of
    similar length), "math" (two matmuls, per group) or "fused" (`model.engines.fused`, one call a layer)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, not {kind!r}")
    if kind == "fused" and (why := fused_unavailable(module, _dtype_of(module))):
        raise ValueError(f"the fused attention kernel is not available: {why}")
    grouped = per_group_attention(_dtype_of(module)) if kind == "fused" else kind
    dtype = _dtype_of(module)
    for layer in module.modules():
        if isinstance(layer, PackedLayer):
            longest = fused_max_tokens(dtype, layer.attn.head_size)
            layer.attn.kernel, layer.attn.grouped, layer.attn.fused_max = kind, grouped, longest
    return kind


def fused_max_tokens(dtype: torch.dtype, head_size: int = 32) -> int:
    """The longest pair the fused kernel attends (longer ones go per group). It takes every pair where it runs
    bfloat16 on AMX tiles (Sapphire Rapids: 1.04-1.57x torch's fastest kernel at every length from 27 to 512
    tokens, the whole forward) or on AVX512-BF16 dot products without AMX (Zen 4: 1.07x flash at 512). Where
    the CPU has AMX but the tile path does not run (head sizes not a multiple of 32, or turned off), torch's
    kernels run on tiles and were never measured against the dot products; there, and in float32 arithmetic,
    pairs up to model.engines.packed.FUSED_MAX_TOKENS."""
    if dtype == torch.bfloat16 and fused.amx() and head_size % 32 == 0:
        return 2**62
    if dtype == torch.bfloat16 and fused.bf16_dot() and "amx_bf16" not in cpu_flags():
        return 2**62
    return FUSED_MAX_TOKENS


def attention_path(kind: str, dtype: str) -> str | None:
    """Which code attends where `kind` is "fused", for /info (AMX tiles, AVX512-BF16 dot products or float32
    arithmetic); None for torch's kernels."""
    return fused.path(getattr(torch, dtype)) if kind == "fused" else None


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(p.dtype for p in module.parameters() if p.is_floating_point())


def per_group_attention(dtype: torch.dtype) -> str:
    """The per-group kernel this CPU serves `dtype` with where the fused one does not: "math" or "sdpa"."""
    return "math" if math_attention_pays(dtype) else "sdpa"


def fused_unavailable(module: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the fused kernel cannot attend for `module` in `dtype` (not built, or a precision or head size it
    does not compute), or None where it can."""
    built, why = fused.available()
    if not built:
        return why
    layers = [m for m in module.modules() if isinstance(m, PackedLayer)]
    if not all(fused.supports(dtype, m.attn.head_size) for m in layers):
        return f"it does not compute {dtype} or these head sizes"
    return None


PROBE_MARGIN = 1.03  # the fused kernel serves where its probe is at least 3% faster

# The probe's batch: a served batch's spread of one-pair requests (14-40 tokens, as inference=auto's probe)
PROBE_LENGTHS = tuple(14 + (7 * i) % 27 for i in range(32))


@torch.inference_mode()
def attention_probe(module: nn.Module, rounds: int = 10) -> dict[str, float]:
    """Milliseconds (best of `rounds`, interleaved) of the first layer's attention on a served batch of 32
    pairs, from its q/k/v rows to its context rows (`SelfAttention.context_packed`: the part the kernels differ
    in), with this CPU's per-group kernel and with the fused one, on one thread (a model process's and a
    forward worker's layout). The projections around it are left out: the same for both, they were four
    fifths of the time timed and their noise flipped the choice on a Zen 3 (2 of 14 starts)."""
    layer = next(m for m in module.modules() if isinstance(m, PackedLayer))
    dtype = _dtype_of(module)
    ids = [[1] * n for n in PROBE_LENGTHS]
    p = pack(ids, [[0] * n for n in PROBE_LENGTHS], torch.device("cpu"), dtype)
    g = torch.Generator().manual_seed(0)
    hidden = layer.attn_norm.normalized_shape[0]
    qkv = layer.attn._project(torch.randn(len(p.ids), hidden, generator=g).to(dtype))
    grouped = per_group_attention(dtype)
    kinds = (grouped, "fused")
    best = {k: float("inf") for k in kinds}
    old, threads = (layer.attn.kernel, layer.attn.grouped), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer.attn.grouped = grouped
        for _ in range(rounds + 1):  # the first round warms both
            for k in kinds:
                layer.attn.kernel = k
                t0 = time.perf_counter()
                layer.attn.context_packed(qkv, p, None)
                best[k] = min(best[k], time.perf_counter() - t0)
    finally:
        layer.attn.kernel, layer.attn.grouped = old
        torch.set_num_threads(threads)
    return {k: round(1e3 * v, 3) for k, v in best.items()}


class AttentionChoice(NamedTuple):
    kind: str  # "fused", "math" or "sdpa"
    probe: dict[str, float] | None  # the start-up probe's ms, where it ran
    reason: str
    fused_norm: bool = False  # the residual adds and norms in the same C library (use_fused_norms)


def choose_attention(module: nn.Module, dtype: torch.dtype, want: str = "auto") -> AttentionChoice:
    """`_attention_kernel`'s choice; with it, where the C library runs and `want` is not "torch" (the operator's
    switch off all of it), the residual adds and norms fused (`use_fused_norms`)."""
    choice = _attention_kernel(module, dtype, want)
    return choice._replace(fused_norm=want != "torch" and use_fused_norms(module, dtype))


def _attention_kernel(module: nn.Module, dtype: torch.dtype, want: str) -> AttentionChoice:
    """Set the packed forward's attention kernel for this CPU and `dtype`, and say which and why. `want`:
    "torch", the per-group kernel ("math" or "sdpa" by `math_attention_pays`, which also serves where the fused
    one cannot run: several torch threads in one forward, autograd, long pairs); "fused", the fused one where it
    is built and computes `dtype`; "auto", the fused one where it also beats the per-group one by PROBE_MARGIN
    in `attention_probe`."""
    if want not in ("auto", "fused", "torch"):
        raise ValueError(f"attention must be auto, fused or torch, not {want!r}")
    grouped = per_group_attention(dtype)
    if want == "torch":
        return AttentionChoice(set_attention(module, grouped), None, "asked for torch's kernels")
    if why := fused_unavailable(module, dtype):
        if want == "fused":
            log.warning("attention=fused asked for, but the fused kernel cannot serve: %s; torch's serve", why)
        return AttentionChoice(set_attention(module, grouped), None, f"{want}: fused kernel unavailable ({why})")
    if want == "fused":
        return AttentionChoice(set_attention(module, "fused"), None, "asked for the fused kernel")
    figures = attention_probe(module)
    # a tie buys nothing, and a margin keeps the choice from flipping between restarts on noise
    kind = "fused" if figures["fused"] * PROBE_MARGIN < figures[grouped] else grouped
    log.info("attention: %s (probe, ms per layer at batch 32: %s)", kind, figures)
    ratio = figures[grouped] / figures["fused"]
    reason = f"auto: probe on 32 pairs of 14-40 tokens, fused {ratio:.2f}x {grouped} (it serves from {PROBE_MARGIN}x)"
    return AttentionChoice(set_attention(module, kind), figures, reason)


def use_fused_norms(module: nn.Module, dtype: torch.dtype) -> bool:
    """Turn on the packed forward's fused residual add + LayerNorm (`model.engines.fused.add_layer_norm`) in
    every layer where the library is built and computes `dtype` and the norms' shapes; say whether it is on.
    No probe: on Sapphire Rapids the op ran 2.1-2.6x torch's two in bfloat16 at 216-830 rows (1.1x at 32), the
    whole 1-thread forward 1.06-1.07x (lab/norm_ab.py, docs/benchmarks.md)."""
    built, _ = fused.available()
    layers = [m for m in module.modules() if isinstance(m, PackedLayer)]
    on = built and all(fused.norm_supports(n, dtype) for m in layers for n in (m.attn_norm, m.ffn_norm))
    for m in layers:
        m.fused_norm = on
    return on


def install_cpu_kernels(module: nn.Module, dtype: torch.dtype) -> str:
    """Swap in the linear layers this CPU runs fastest in `dtype`, and say which: "onednn-packed" where they
    pay and the probe of the private ops they rest on passes; "fused" where they do not pay; the plain layers,
    "plain (probe failed: ...)", where the probe fails (logged once)."""
    if not onednn_available(dtype):
        return "plain"
    if not onednn_pays(dtype):
        use_fused_linears(module)
        return "fused"
    failure = probe(dtype)
    if failure is not None:
        log.warning("oneDNN packed linear layers off, plain nn.Linear instead: probe failed: %s", failure)
        return f"plain (probe failed: {failure})"
    use_onednn_linears(module)
    return "onednn-packed"


def _fused(lin: type, weights: list[nn.Linear]) -> OneDNNLinear | nn.Linear:
    w = torch.cat([x.weight for x in weights])
    b = torch.cat([x.bias for x in weights])
    if lin is OneDNNLinear:
        return OneDNNLinear(w, b)
    out = nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
    out.weight.copy_(w)
    out.bias.copy_(b)
    return out.requires_grad_(False)


def _fuse_projections(model: nn.Module, lin: type) -> None:
    """q/k/v as one layer, except in the last layer: q, k and v apart there, since the packed forward needs
    q for the [CLS] rows only (model.engines.packed), and k and v then have the output layer's shape, whose
    oneDNN kernels exist anyway (a k/v layer of its own shape cost ~50 MB of kernels over the warm-up ladder).
    Each weight is kept once."""
    layers = [m for m in model.modules() if isinstance(m, PackedLayer)]
    for i, layer in enumerate(layers):
        a = layer.attn
        if i == len(layers) - 1:
            a.cls_q, a.cls_k, a.cls_v = _fused(lin, [a.query]), _fused(lin, [a.key]), _fused(lin, [a.value])
        else:
            a.qkv = _fused(lin, [a.query, a.key, a.value])
        del a.query, a.key, a.value


@torch.no_grad()
def use_fused_linears(model: nn.Module) -> None:
    """Plain linear layers, q/k/v fused (one matmul instead of three). Inference only, like the oneDNN
    layers: the module is no longer saved or trained."""
    _fuse_projections(model, nn.Linear)


def _weights(lin: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    assert isinstance(lin, nn.Linear), f"{type(lin).__name__} already swapped"
    return lin.weight, lin.bias


@torch.no_grad()
def use_onednn_linears(model: nn.Module) -> None:
    """Swap the encoder's linear layers for pre-packed oneDNN ones (fused q/k/v, GELU fused into the
    feed-forward's first matmul). Inference only: packed weights are not trained or saved."""
    _fuse_projections(model, OneDNNLinear)
    for layer in model.modules():
        if not isinstance(layer, PackedLayer):
            continue
        a = layer.attn
        a.out = OneDNNLinear(*_weights(a.out))
        gelu = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}.get(layer.act_name)
        if gelu is not None:  # GELU in the up-projection's kernel
            layer.up = OneDNNLinear(*_weights(layer.up), "gelu", gelu)
            layer.act = nn.Identity()
        else:
            layer.up = OneDNNLinear(*_weights(layer.up))
        layer.down = OneDNNLinear(*_weights(layer.down))


@torch.inference_mode()
def warm_linear_shapes(module: BertForRelevance, max_tokens: int) -> int:
    """Run every distinct linear layer of the encoder once per token bucket up to `max_tokens`, so that
    oneDNN's kernels for those shapes exist before the first request. Returns the shapes warmed."""
    seen: dict[tuple[type, int, int, str | None], tuple[nn.Module, int]] = {}
    for m in module.modules():
        if isinstance(m, PackedLayer):
            a = m.attn
            lins = [x for x in (a.qkv, a.cls_q, a.cls_k, a.cls_v) if x is not None] or [a.query, a.key, a.value]
            for lin in lins + [a.out, m.up, m.down]:
                assert isinstance(lin, (nn.Linear, OneDNNLinear)), type(lin)
                fan_in = lin.weight_in if isinstance(lin, OneDNNLinear) else lin.in_features
                seen.setdefault((type(lin), fan_in, lin.out_features, getattr(lin, "act", None)), (lin, fan_in))
    ref = module.bert.embeddings.word.weight
    for n in token_buckets(max_tokens):
        for lin, fan_in in seen.values():
            lin(torch.zeros(n, fan_in, dtype=ref.dtype, device=ref.device))
    return len(seen) * len(token_buckets(max_tokens))
