"""The packed encoder: the reference `model.bert` classes with a forward over batches without padding.

Each class here subclasses its reference and adopts the reference's weights (no copy), so the padded
forward, the checkpoint names and the head mask stay the reference's, and the packed forward sits beside
them (TEI keeps `flash_bert.rs` beside `bert.rs` the same way). The batch layout is `model.packing`'s;
`model.engines.kernels` may fuse the projections and swap the linear layers for pre-packed oneDNN ones. The
packed forward computes the last layer for each pair's [CLS] only, since nothing else of it is read: exact,
and ~14% of the encoder's multiply-adds saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.bert import BertEncoder, BertForRelevance, Embeddings, Layer, SelfAttention
from model.engines.fused import Rows, add_norm, packed_attention, parallel
from model.packing import AttentionGroup, Packing, pack, token_bucket

# In float32 arithmetic the fused kernel attends the pairs of at most this many tokens, longer ones per group
# (model.engines.kernels.fused_max_tokens: its AMX and AVX512-BF16 paths take every pair). On a Zen 3
# (float32, one layer's attention) it ran 1.09x torch's flash kernel at 64 tokens, 0.93x at 256, 0.81x at 512:
# that kernel blocks long rows for the cache. On a Zen 4 the whole forward: 0.91x at 512 (lab/long_pairs.py).
FUSED_MAX_TOKENS = 192
# `math_attention` only on blocks of fewer keys: from 64 on, torch's flash kernel ran the whole bfloat16 forward
# 1.2-1.3x faster (2.2x at 512 tokens), below it 0.91-0.93x (AMD EPYC Zen 4, 1 and 2 threads; docs/benchmarks.md)
MATH_MAX_TOKENS = 63


def math_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """Attention as two matmuls in the inputs' precision around a float32 softmax. On the short blocks of
    the packed forward it beats torch's CPU flash kernel in bfloat16 where there is no AMX
    (`model.engines.kernels.math_attention_pays`): that kernel's per-block set-up outweighs the work."""
    s = torch.matmul(q, k.transpose(-1, -2)).float()
    scale = q.shape[-1] ** -0.5
    s = s.mul_(scale) if bias is None else torch.add(bias, s, alpha=scale)
    return torch.matmul(s.softmax(-1).to(q.dtype), v)


def embed(e: Embeddings, p: Packing) -> Tensor:
    """(N, H) embeddings of the packed tokens."""
    return e.sum(p.ids, p.segments, p.positions)


class PackedSelfAttention(SelfAttention):
    """The reference attention (its weights adopted) with the packed forward's kernels."""

    def __init__(self, ref: SelfAttention):
        nn.Module.__init__(self)
        self.heads, self.head_size, self.dropout_p = ref.heads, ref.head_size, ref.dropout_p
        self.query, self.key, self.value, self.out = ref.query, ref.key, ref.value, ref.out
        self.qkv: nn.Module | None = None  # fused q/k/v projection, set by model.engines.kernels
        # Instead of qkv in the last layer (model.engines.kernels): q for the [CLS] rows apart from k and v for
        # every token
        self.cls_q: nn.Module | None = None
        self.cls_k: nn.Module | None = None
        self.cls_v: nn.Module | None = None
        # the packed forward's kernel, set by model.engines.kernels: "fused" (model.engines.fused: one call over every
        # pair's rows in place) or a per-group one, `grouped`: "sdpa" (torch's) or "math"
        self.kernel = "sdpa"
        self.grouped = "sdpa"  # also where "fused" cannot run (several threads, autograd)
        self.fused_max = FUSED_MAX_TOKENS  # longer pairs attend per group (model.engines.kernels sets it per path)

    def project(self, x: Tensor, x_cls: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.qkv is not None and x_cls is x:
            q, k, v = self._project(x).split(len(self.heads) * self.head_size, dim=-1)
            return q, k, v
        return self._cls_projections(x, x_cls)

    def _project(self, x: Tensor) -> Tensor:
        """q, k and v of `x`, concatenated along the last dimension, from whichever layers model.engines.kernels
        left."""
        if self.qkv is not None:
            return cast(Tensor, self.qkv(x))
        return torch.cat(self._cls_projections(x, x), dim=-1)

    def _cls_projections(self, x: Tensor, x_cls: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q for `x_cls`, k and v for `x`: from cls_q, cls_k and cls_v where model.engines.kernels split the last
        layer's projections so (k and v apart: their shape is the output layer's, whose oneDNN kernels are built
        anyway, where one k/v layer cost ~50 MB of kernels for its own shape), else from query, key and value."""
        if self.cls_q is not None and self.cls_k is not None and self.cls_v is not None:
            return self.cls_q(x_cls), self.cls_k(x), self.cls_v(x)
        return self.query(x_cls), self.key(x), self.value(x)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
        if self.grouped == "math" and k.shape[-2] <= MATH_MAX_TOKENS:
            return math_attention(q, k, v, bias)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def _fused(self) -> bool:
        # several threads only on torch's OpenMP team (fused.parallel); no autograd through ctypes
        return self.kernel == "fused" and (torch.get_num_threads() == 1 or parallel()) and not torch.is_grad_enabled()

    def forward_packed(self, x: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        """x: (N, H) packed tokens -> (N, H)."""
        return cast(Tensor, self.out(self.context_packed(self._project(x), p, head_mask)))

    def context_packed(self, qkv: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        """qkv: (N, 3 * nh * hs) packed projections -> (N, nh * hs) context rows, before the output layer: the
        part the attention kernels differ in (model.engines.kernels.attention_probe times it). Per group, on a
        (b, nh, t, hs) block, unless the fused kernel runs; that one leaves pairs over `fused_max` tokens to the
        groups (the first pairs: longest first)."""
        nh, hs = len(self.heads), self.head_size
        if not self._fused():
            parts = self._grouped(qkv, p.groups, head_mask) + ([qkv.new_zeros(p.spare, nh * hs)] if p.spare else [])
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        w, n = nh * hs, p.longer_than(self.fused_max)
        # filler rows (p.spare) are no pair's: zeroed, as the grouped path leaves them
        ctx = qkv.new_zeros(len(qkv), w) if p.spare else qkv.new_empty(len(qkv), w)
        if n < len(p.lengths):
            rows = p.memo("rows", lambda: Rows(p.starts[n:], p.lengths[n:], p.starts[n:], p.lengths[n:]))
            packed_attention(qkv[:, :w], qkv[:, w : 2 * w], qkv[:, 2 * w :], ctx, rows, nh, hs, head_mask)
        if n:
            long = self._grouped(qkv, p.groups_of_first(n), head_mask)
            torch.cat(long, out=ctx[: int(p.starts[n - 1] + p.lengths[n - 1])])
        return ctx

    def _grouped(self, qkv: Tensor, groups: list[AttentionGroup], head_mask: Tensor | None) -> list[Tensor]:
        """The context rows of the pairs in `groups`, a (rows, nh * hs) tensor per group, in packed order."""
        nh, hs = len(self.heads), self.head_size
        parts = []
        for g in groups:
            q, k, v = qkv.index_select(0, g.gather).view(g.b, g.t, 3, nh, hs).permute(2, 0, 3, 1, 4)
            ctx = self._attend(q, k, v, g.bias)  # (b, nh, t, hs)
            if head_mask is not None:
                ctx = ctx * head_mask.view(1, nh, 1, 1).to(ctx.dtype)
            ctx = ctx.transpose(1, 2).reshape(g.b * g.t, nh * hs)
            parts.append(ctx if g.real is None else ctx.index_select(0, g.real))
        return parts

    def forward_packed_cls(self, x: Tensor, p: Packing, rows: Tensor, head_mask: Tensor | None) -> Tensor:
        """The attention output of each pair's [CLS] only, for the last layer: x (N, H) packed tokens,
        `rows` (M,) the packed pairs' [CLS] rows, padded to a token bucket -> (M, H); keys and values
        still come from every token."""
        nh, hs = len(self.heads), self.head_size
        q, k_all, v_all = self._cls_projections(x, x.index_select(0, rows))
        w, b = nh * hs, len(p.lengths)
        n = p.longer_than(self.fused_max) if self._fused() else b
        ctx = q.new_zeros(len(q), w)  # rows past the pairs' (bucket filler) stay zero
        if n < b:  # pair i's one query: row i of q
            cls = p.memo(
                "cls rows", lambda: Rows(np.arange(n, b), np.ones(b - n, np.int64), p.starts[n:], p.lengths[n:])
            )
            packed_attention(q, k_all, v_all, ctx, cls, nh, hs, head_mask)
        start = 0
        for g in p.groups_of_first(n) if n else []:  # groups hold consecutive packed pairs, as `rows` does
            k, v = (t.index_select(0, g.gather).view(g.b, g.t, nh, hs).transpose(1, 2) for t in (k_all, v_all))
            c = self._attend(q[start : start + g.b].view(g.b, nh, 1, hs), k, v, g.bias)  # (b, nh, 1, hs)
            if head_mask is not None:
                c = c * head_mask.view(1, nh, 1, 1).to(c.dtype)
            ctx[start : start + g.b] = c.reshape(g.b, w)
            start += g.b
        return cast(Tensor, self.out(ctx))


class PackedLayer(Layer):
    """The reference layer (its weights adopted) with the packed forward."""

    def __init__(self, ref: Layer):
        nn.Module.__init__(self)
        self.attn: PackedSelfAttention = PackedSelfAttention(ref.attn)
        self.attn_norm, self.up, self.act_name, self.act = ref.attn_norm, ref.up, ref.act_name, ref.act
        self.down, self.ffn_norm, self.dropout = ref.down, ref.ffn_norm, ref.dropout
        self.fused_norm = False  # the packed forward's add + norm in one pass (model.engines.kernels.use_fused_norms)

    def forward_packed(self, x: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        """x: (N, H) packed tokens -> (N, H)."""
        x = add_norm(self.attn_norm, x, self.attn.forward_packed(x, p, head_mask), self.fused_norm)
        return add_norm(self.ffn_norm, x, self.down(self.act(self.up(x))), self.fused_norm)

    def forward_packed_cls(self, x: Tensor, p: Packing, rows: Tensor, head_mask: Tensor | None) -> Tensor:
        """x: (N, H) packed tokens -> (M, H), this layer's output at `rows` (the [CLS] rows) only."""
        a = self.attn.forward_packed_cls(x, p, rows, head_mask)
        h = add_norm(self.attn_norm, x.index_select(0, rows), a, self.fused_norm)
        return add_norm(self.ffn_norm, h, self.down(self.act(self.up(h))), self.fused_norm)


class PackedEncoder(BertEncoder):
    """The reference encoder (its weights adopted) with the packed forward."""

    def __init__(self, ref: BertEncoder):
        nn.Module.__init__(self)
        self.cfg, self.embeddings, self.pooler = ref.cfg, ref.embeddings, ref.pooler
        self.layers = nn.ModuleList(PackedLayer(layer) for layer in ref.blocks)

    @property
    def blocks(self) -> list[PackedLayer]:  # type: ignore[override]  # the packed layers, typed
        return cast("list[PackedLayer]", list(self.layers))

    def forward_packed(self, p: Packing, head_mask: Tensor | None = None) -> Tensor:
        """Inference without padding -> (B, H): the pooled [CLS] (or the raw [CLS] without a pooler),
        in packed order."""
        self.check_head_mask(head_mask)
        x = embed(self.embeddings, p)
        *body, last = self.blocks
        for i, layer in enumerate(body):
            hm = None if head_mask is None else head_mask[i, layer.attn.heads].to(x.device)
            x = layer.forward_packed(x, p, hm)
        hm = None if head_mask is None else head_mask[len(body), last.attn.heads].to(x.device)
        b = len(p.cls)
        # [CLS] rows padded to a token bucket (copies of the first): the last layer's linears meet warmed shapes only
        rows = torch.cat([p.cls, p.cls[:1].expand(token_bucket(b) - b)])
        cls = last.forward_packed_cls(x, p, rows, hm)[:b]
        return self.pooler.pool(cls) if self.pooler is not None else cls


class PackedBertForRelevance(BertForRelevance):
    """The reference model (its weights adopted) with `forward_packed`, the packed engine's forward."""

    def __init__(self, ref: BertForRelevance):
        nn.Module.__init__(self)
        self.cfg, self.dropout, self.classifier = ref.cfg, ref.dropout, ref.classifier
        self.bert: PackedEncoder = PackedEncoder(ref.bert)
        self.train(ref.training)

    def forward_packed(
        self,
        input_ids: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]],
        head_mask: Tensor | None = None,
    ) -> Tensor:
        """Inference on variable-length pairs without padding -> (B, num_labels) logits, in input order.
        Equal to `forward` on the padded batch (float32: to ~1e-6)."""
        if self.training:
            raise RuntimeError("forward_packed is for inference; train through forward")
        w = self.bert.embeddings.word.weight  # (int8 models quantise the linear layers, not this)
        p = pack(input_ids, token_type_ids, w.device, w.dtype)
        logits = self.classifier(self.bert.forward_packed(p, head_mask))
        return torch.empty_like(logits).index_copy_(0, p.order, logits)


def packed(module: BertForRelevance) -> PackedBertForRelevance:
    """`module` with the packed forward, sharing its weights (the packed form of a packed one is itself)."""
    return module if isinstance(module, PackedBertForRelevance) else PackedBertForRelevance(module)
