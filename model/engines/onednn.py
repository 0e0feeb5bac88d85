"""oneDNN linear layers with pre-packed weights, and the probe that says whether this torch and CPU run
them right. A leaf: it knows nothing of the encoder (model.engines.kernels swaps these into it).

This rests on two private torch ops, `torch.ops.mkldnn._reorder_linear_weight` and
`torch.ops.mkldnn._linear_pointwise`, which a torch release may change or drop, and which refuse
bfloat16 on CPUs without the needed instructions. `probe` runs them on a tiny layer beside `nn.Linear`
before a model uses them; where it fails, the model keeps the plain layers (model.relevance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Tolerances of the probe: oneDNN and torch's default kernels accumulate in different orders.
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


class OneDNNLinear(nn.Module):
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


class OneDNNGeGLU(nn.Module):
    """A GeGLU feed-forward's input half in one oneDNN pass per half: act(x W_a + b_a) * (x W_g + b_g), the
    activation fused into the first projection's kernel and the product into the second's (a binary post-op),
    so neither the activation nor the product runs as an op of its own. `weight`, `bias`: the up projection's
    (2I, in) and (2I,), the activation's input half first (ModernBERT's `up`)."""

    def __init__(self, weight: Tensor, bias: Tensor, algorithm: str = "none"):
        super().__init__()
        half = weight.shape[0] // 2
        self.out_features, self.weight_in = half, weight.shape[1]
        self.act = OneDNNLinear(weight[:half], bias[:half], "gelu", algorithm)
        self.gate = torch.ops.mkldnn._reorder_linear_weight(weight[half:].detach().contiguous(), 256)
        self.gate_bias = bias[half:].detach().contiguous()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(x, self.act(x), self.gate, self.gate_bias, "mul")


@torch.inference_mode()
def geglu_probe(dtype: torch.dtype) -> str | None:
    """None when `OneDNNGeGLU` computes GELU(x W_a + b_a) * (x W_g + b_g) on this torch and CPU in `dtype`
    (exact and tanh GELU); otherwise why not, in one line."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g).to(dtype)
    w, b = (torch.randn(64, 16, generator=g) * 0.25).to(dtype), torch.randn(64, generator=g).to(dtype)
    for algorithm in ("none", "tanh"):
        a, gate = F.linear(x, w, b).chunk(2, dim=-1)
        want = (F.gelu(a.float(), approximate=algorithm) * gate.float()).to(dtype)
        try:
            got = OneDNNGeGLU(w, b, algorithm)(x)
        except Exception as e:  # a missing op is an AttributeError, a refused dtype a RuntimeError
            return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        diff = (got.float() - want.float()).abs()
        if got.shape != want.shape or bool((diff > 2 * PROBE_TOLERANCE[dtype] * (1 + want.float().abs())).any()):
            return f"GeGLU {algorithm}: differs from torch's ops by up to {diff.max().item():.3g}"
    return None


def onednn_available(dtype: torch.dtype) -> bool:
    return torch.backends.mkldnn.is_available() and dtype in (torch.float32, torch.bfloat16)


@torch.inference_mode()
def probe(dtype: torch.dtype) -> str | None:
    """None when `OneDNNLinear` computes what `nn.Linear` does on this torch and CPU, in `dtype`, for
    every variant `use_onednn_linears` uses (plain, GELU fused exact and tanh; zero and non-zero bias; 2-D and
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
                got = OneDNNLinear(lin.weight, lin.bias, act, algorithm)(inp)
            except Exception as e:  # a missing op is an AttributeError, a refused dtype a RuntimeError
                return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            case = f"{str(dtype).removeprefix('torch.')} 16->{out} {act}/{algorithm or '-'} on {tuple(inp.shape)}"
            if got.shape != want.shape or got.dtype != want.dtype:
                return f"{case}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
            diff = (got.float() - want.float()).abs()
            if not bool(torch.isfinite(got).all()) or bool((diff > tol * (1 + want.float().abs())).any()):
                return f"{case}: differs from nn.Linear by up to {diff.max().item():.3g}"
    return None
