"""ModernBERT's fast CPU path: batches without padding (`model.packing`), the linear layers pre-packed for
oneDNN where they pay (model.kernels.onednn_pays and its probe), and attention per group of pairs of similar
length, with the local layers' window laid over each group's key mask. The last norm, the pooling and the
head run on each pair's rows. Equal to ModernBertForRelevance's padded forward (float32: to ~1e-6)."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.arch import Network
from model.engines.base import EngineKind, Ids, Kernels
from model.engines.kernels import onednn_available, onednn_pays, per_group_attention, probe
from model.engines.onednn import OneDNNLinear
from model.engines.packed import MATH_MAX_TOKENS, math_attention
from model.modernbert import Layer, ModernBertForRelevance, rotary, rotate
from model.packing import AttentionGroup, Packing, pack, token_bucket, token_buckets


class PackedModernBert(ModernBertForRelevance):
    """The reference model (its weights adopted) with `forward_packed`."""

    def __init__(self, ref: ModernBertForRelevance):
        nn.Module.__init__(self)
        self.cfg, self.encoder, self.dense, self.head_act = ref.cfg, ref.encoder, ref.dense, ref.head_act
        self.head_norm, self.dropout, self.classifier = ref.head_norm, ref.dropout, ref.classifier
        self.grouped = per_group_attention(ref.classifier.weight.dtype)  # "math" or "sdpa" (model.kernels)
        self.train(ref.training)

    def forward_packed(self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None) -> Tensor:
        """(B, num_labels) logits of variable-length pairs, in input order."""
        enc = self.encoder
        w = enc.word.weight
        p = pack(input_ids, token_type_ids, w.device, w.dtype)
        x = enc.embed_norm(enc.word(p.ids))  # (N, H)
        ropes: dict[tuple[int, float], tuple[Tensor, Tensor]] = {}
        last = len(enc.blocks) - 1
        cls_only = self.cfg.classifier_pooling == "cls"
        b = len(p.cls)
        # [CLS] rows padded to a token bucket (copies of the first): the last layer's linears meet warmed shapes only
        rows = torch.cat([p.cls, p.cls[:1].expand(token_bucket(b) - b)])
        for i, layer in enumerate(enc.blocks):
            hm = None if head_mask is None else head_mask[i].to(x.device)
            ctx = self._attend(layer, layer.qkv(layer.attn_norm(x)), p, ropes, hm)
            if i == last and cls_only:  # nothing but [CLS] is read of the last layer: exact, and less work
                x, ctx = x.index_select(0, rows), ctx.index_select(0, rows)
            x = x + layer.out(ctx)
            gate_in, gate = layer.up(layer.mlp_norm(x)).chunk(2, dim=-1)
            x = x + layer.down(layer.act(gate_in) * gate)
        x = enc.final_norm(x)
        if cls_only:
            pooled = x[:b]
        else:  # each pair's rows, averaged
            sums = torch.zeros(len(p.lengths), x.shape[1], dtype=torch.float32, device=x.device)
            owner = torch.repeat_interleave(torch.arange(len(p.lengths)), torch.from_numpy(p.lengths)).to(x.device)
            sums.index_add_(0, owner, x[: len(owner)].float())
            pooled = (sums / torch.from_numpy(p.lengths).to(sums)[:, None]).to(x.dtype)
        logits = self.classifier(self.head_norm(self.head_act(self.dense(pooled))))
        return torch.empty_like(logits).index_copy_(0, p.order, logits)

    def _attend(
        self,
        layer: Layer,
        qkv: Tensor,
        p: Packing,
        ropes: dict[tuple[int, float], tuple[Tensor, Tensor]],
        head_mask: Tensor | None,
    ) -> Tensor:
        """(N, 3H) packed projections -> (N, H) context rows, group by group (filler rows zero)."""
        nh, hs = layer.heads, layer.head_size
        parts = []
        for g in p.groups:
            key = (g.t, layer.theta)
            if key not in ropes:
                ropes[key] = rotary(torch.arange(g.t, device=qkv.device), hs, layer.theta, qkv.dtype)
            q, k, v = qkv.index_select(0, g.gather).view(g.b, g.t, 3, nh, hs).permute(2, 0, 3, 1, 4)
            q, k = rotate(q, *ropes[key]), rotate(k, *ropes[key])
            bias = self._window(p, g, qkv.dtype) if layer.local else g.bias
            if self.grouped == "math" and g.t <= MATH_MAX_TOKENS:  # short blocks: two matmuls beat flash here
                ctx = math_attention(q, k, v, bias)  # (b, nh, t, hs)
            else:
                ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            if head_mask is not None:
                ctx = ctx * head_mask.view(1, nh, 1, 1).to(ctx.dtype)
            ctx = ctx.transpose(1, 2).reshape(g.b * g.t, nh * hs)
            parts.append(ctx if g.real is None else ctx.index_select(0, g.real))
        if p.spare:
            parts.append(qkv.new_zeros(p.spare, nh * hs))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _window(self, p: Packing, g: AttentionGroup, dtype: torch.dtype) -> Tensor:
        """(b, 1, t, t) additive mask of a local layer: keys within half the window, and not padding; made once
        a forward (every local layer reuses it)."""
        return cast(Tensor, p.memo(f"window {id(g)}", lambda: self._make_window(g, dtype)))

    def _make_window(self, g: AttentionGroup, dtype: torch.dtype) -> Tensor:
        pos = torch.arange(g.t, device=g.gather.device)
        near = (pos[None, :] - pos[:, None]).abs() <= self.cfg.local_attention // 2  # (t, t)
        keys = torch.ones(g.b, 1, 1, g.t, dtype=torch.bool, device=near.device) if g.bias is None else g.bias == 0
        return torch.zeros(g.b, 1, g.t, g.t, dtype=dtype, device=near.device).masked_fill(
            ~(keys & near), torch.finfo(dtype).min
        )


def _linears(module: PackedModernBert) -> list[tuple[Layer, str]]:
    return [(layer, name) for layer in module.encoder.blocks for name in ("qkv", "out", "up", "down")]


@torch.no_grad()
def install_linears(module: PackedModernBert, dtype: torch.dtype) -> str:
    """oneDNN's pre-packed linear layers where they pay and the probe passes, as model.kernels does for BERT;
    say which layers run ("onednn-packed", "plain", "plain (probe failed: ...)")."""
    if not onednn_available(dtype) or not onednn_pays(dtype):
        return "plain"
    failure = probe(dtype)
    if failure is not None:
        return f"plain (probe failed: {failure})"
    for layer, name in _linears(module):
        lin = cast(nn.Linear, getattr(layer, name))
        bias = lin.bias if lin.bias is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
        setattr(layer, name, OneDNNLinear(lin.weight, bias))
    return "onednn-packed"


class ModernPackedEngine:
    """ModernBERT's batches without padding through `PackedModernBert.forward_packed` (cpu only); a torch
    engine (model.engines.base.TorchForward)."""

    kind = EngineKind.PACKED
    own_threads = False

    def __init__(self, module: PackedModernBert, device: torch.device, pad_id: int, kernels: Kernels):
        self.module: Network = module
        self.packed = module
        self.device, self.pad_id, self.kernels = device, pad_id, kernels

    def use_attention(self, kind: str) -> None:
        """The per-group attention kernel, "math" or "sdpa" (A/Bs); the fused kernel is BERT's."""
        if kind not in ("math", "sdpa"):
            raise ValueError(f"ModernBERT attends per group with math or sdpa, not {kind!r}")
        self.packed.grouped = kind
        self.kernels = replace(self.kernels, attention=kind, attention_reason="set by use_attention")

    def logits(
        self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None, on_device: bool = False
    ) -> Tensor:
        return self.packed.forward_packed(input_ids, token_type_ids, head_mask).float().cpu()

    @torch.inference_mode()
    def warm_up(self, max_batch_tokens: int) -> None:
        """Every distinct linear layer at every packed token count up to `max_batch_tokens`: oneDNN builds a
        kernel per shape."""
        if self.kernels.cpu_kernels != "onednn-packed":
            return
        seen: dict[tuple[int, int], OneDNNLinear] = {}
        for layer, name in _linears(self.packed):
            lin = cast(OneDNNLinear, getattr(layer, name))
            seen.setdefault((lin.weight_in, lin.out_features), lin)
        dtype = self.packed.encoder.word.weight.dtype
        for n in token_buckets(max_batch_tokens):
            for (fan_in, _), lin in seen.items():
                lin(torch.zeros(n, fan_in, dtype=dtype))

    @property
    def torch(self) -> ModernPackedEngine:  # last in the class: the name would shadow the module above it
        return self


def modern_engine(
    module: ModernBertForRelevance, device: torch.device, dtype: torch.dtype, pad_id: int, onednn: bool
) -> ModernPackedEngine:
    """The packed engine for a ModernBERT module (already cast to `dtype`), oneDNN linears with `onednn`."""
    packed = PackedModernBert(module)
    why = "ModernBERT attends per group of similar length (the fused kernel is BERT's)"
    kernels = Kernels(install_linears(packed, dtype) if onednn else "plain", packed.grouped, None, why)
    return ModernPackedEngine(packed, device, pad_id, kernels)
