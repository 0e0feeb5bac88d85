"""The CPU kernel layer: the encoder's linear layers swapped for oneDNN ones with pre-packed weights
(`model.onednn`, where its probe passes), and their kernels built for every token bucket at warm-up."""

from __future__ import annotations

import torch
from torch import nn

from model.bert import BertForRelevance, Layer
from model.onednn import OneDNNLinear, onednn_available, probe
from model.packing import token_buckets

__all__ = ["OneDNNLinear", "onednn_available", "probe", "use_onednn_linears", "warm_linear_shapes"]


@torch.no_grad()
def use_onednn_linears(model: nn.Module) -> None:
    """Swap the encoder's linear layers for pre-packed oneDNN ones (fused q/k/v, GELU fused into the
    feed-forward's first matmul). Inference only: packed weights are not trained or saved."""
    for layer in model.modules():
        if not isinstance(layer, Layer):
            continue
        a = layer.attn
        a.qkv = OneDNNLinear(
            torch.cat([a.query.weight, a.key.weight, a.value.weight]),
            torch.cat([a.query.bias, a.key.bias, a.value.bias]),
        )
        a.out = OneDNNLinear(a.out.weight, a.out.bias)
        del a.query, a.key, a.value
        fused = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}.get(layer.act_name)
        if fused is not None:
            layer.up = OneDNNLinear(layer.up.weight, layer.up.bias, "gelu", fused)
            layer.act = nn.Identity()
        else:
            layer.up = OneDNNLinear(layer.up.weight, layer.up.bias)
        layer.down = OneDNNLinear(layer.down.weight, layer.down.bias)


@torch.inference_mode()
def warm_linear_shapes(module: BertForRelevance, max_tokens: int) -> int:
    """Run every distinct linear layer of the encoder once per token bucket up to `max_tokens`, so that
    oneDNN's kernels for those shapes exist before the first request. Returns the shapes warmed."""
    seen: dict[tuple, tuple[nn.Linear | OneDNNLinear, int]] = {}
    for m in module.modules():
        if isinstance(m, Layer):
            a = m.attn
            lins: list[nn.Linear | OneDNNLinear] = [a.qkv] if a.qkv is not None else [a.query, a.key, a.value]
            for lin in lins + [a.out, m.up, m.down]:
                fan_in = lin.weight_in if isinstance(lin, OneDNNLinear) else lin.in_features
                seen.setdefault((type(lin), fan_in, lin.out_features, getattr(lin, "act", None)), (lin, fan_in))
    ref = module.bert.embeddings.word.weight
    for n in token_buckets(max_tokens):
        for lin, fan_in in seen.values():
            lin(torch.zeros(n, fan_in, dtype=ref.dtype, device=ref.device))
    return len(seen) * len(token_buckets(max_tokens))
