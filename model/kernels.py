"""The CPU kernel layer: the encoder's linear layers on oneDNN with pre-packed weights.

This rests on two private torch ops, `torch.ops.mkldnn._reorder_linear_weight` and
`torch.ops.mkldnn._linear_pointwise`, which a torch release may change or drop, and which refuse
bfloat16 on CPUs without the needed instructions. `probe` runs them on a tiny layer beside `nn.Linear`
before a model is packed; where it fails, the model keeps the plain layers (model.classifier).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.bert import BertForRelevance, Layer
from model.packing import token_buckets

# Tolerances of the probe: oneDNN and torch's default kernels accumulate in different orders.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class PackedLinear(nn.Module):
    """Inference-only linear layer on oneDNN with the weight pre-packed once, optionally with the
    activation fused into the same kernel. On CPU this reaches about twice the matmul throughput of
    torch's default float32 path (see docs/benchmarks.md)."""

    def __init__(self, weight: Tensor, bias: Tensor, act: str = "none", algorithm: str = ""):
        super().__init__()
        self.out_features, self.weight_in = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 256)
        self.bias = bias.detach()
        self.act, self.algorithm = act, algorithm

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, self.act, [], self.algorithm)


def can_pack(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


@torch.inference_mode()
def probe(dtype: torch.dtype) -> str | None:
    """None when `PackedLinear` computes what `nn.Linear` does on this torch and CPU, in `dtype`, for
    every variant `pack_for_cpu` uses (plain, GELU fused exact and tanh; zero and non-zero bias; 2-D and
    3-D inputs); otherwise why not, in one line."""
    g = torch.Generator().manual_seed(0)
    tol = PROBE_TOLERANCE[dtype]
    x = torch.randn(8, 16, generator=g).to(dtype)  # (N, in), as the packed forward feeds the layers
    for out, act, algorithm, with_bias in (
        (24, "none", "", True),
        (32, "none", "", False),
        (32, "gelu", "none", True),
        (16, "gelu", "tanh", True),
    ):
        lin = nn.Linear(16, out)
        lin.weight.copy_(torch.randn(out, 16, generator=g) * 0.25)
        lin.bias.copy_(torch.randn(out, generator=g) if with_bias else torch.zeros(out))
        lin = lin.to(dtype)
        for inp in (x, x.view(2, 4, 16)):  # and (B, T, in), as the padded forward does
            want = lin(inp)
            if act == "gelu":
                want = F.gelu(want, approximate=algorithm)
            try:
                got = PackedLinear(lin.weight, lin.bias, act, algorithm)(inp)
            except Exception as e:  # a missing op is an AttributeError, a refused dtype a RuntimeError
                return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            case = f"{str(dtype).removeprefix('torch.')} 16->{out} {act}/{algorithm or '-'} on {tuple(inp.shape)}"
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"{case}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
            diff = (got.float() - want.float()).abs()
            if not bool(torch.isfinite(got).all()) or bool((diff > tol * (1 + want.float().abs())).any()):
                return f"{case}: differs from nn.Linear by up to {diff.max().item():.3g}"
    return None


@torch.no_grad()
def pack_for_cpu(model: nn.Module) -> None:
    """Swap the encoder's linear layers for pre-packed oneDNN ones (fused q/k/v, GELU fused into the
    feed-forward's first matmul). Inference only: packed weights are not trained or saved."""
    for layer in model.modules():
        if not isinstance(layer, Layer):
            continue
        a = layer.attn
        a.qkv = PackedLinear(
            torch.cat([a.query.weight, a.key.weight, a.value.weight]),
            torch.cat([a.query.bias, a.key.bias, a.value.bias]),
        )
        a.out = PackedLinear(a.out.weight, a.out.bias)
        del a.query, a.key, a.value
        fused = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}.get(layer.act_name)
        if fused is not None:
            layer.up = PackedLinear(layer.up.weight, layer.up.bias, "gelu", fused)
            layer.act = nn.Identity()
        else:
            layer.up = PackedLinear(layer.up.weight, layer.up.bias)
        layer.down = PackedLinear(layer.down.weight, layer.down.bias)


@torch.inference_mode()
def warm_linear_shapes(module: BertForRelevance, max_tokens: int) -> int:
    """Run every distinct linear layer of the encoder once per token bucket up to `max_tokens`, so that
    oneDNN's kernels for those shapes exist before the first request. Returns the shapes warmed."""
    seen: dict[tuple, tuple[nn.Linear | PackedLinear, int]] = {}
    for m in module.modules():
        if isinstance(m, Layer):
            a = m.attn
            lins: list[nn.Linear | PackedLinear] = [a.qkv] if a.qkv is not None else [a.query, a.key, a.value]
            for lin in lins + [a.out, m.up, m.down]:
                fan_in = lin.weight_in if isinstance(lin, PackedLinear) else lin.in_features
                seen.setdefault((type(lin), fan_in, lin.out_features, getattr(lin, "act", None)), (lin, fan_in))
    ref = module.bert.embeddings.word.weight
    for n in token_buckets(max_tokens):
        for lin, fan_in in seen.values():
            lin(torch.zeros(n, fan_in, dtype=ref.dtype, device=ref.device))
    return len(seen) * len(token_buckets(max_tokens))
