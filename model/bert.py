"""BERT encoder in plain PyTorch: embeddings, post-norm attention + feed-forward layers, pooler.

Two attention paths share the same weights: a fast one through `scaled_dot_product_attention`, and a
plain one that materialises the (B, nh, T, T) probabilities so they can be returned. Both take a head
mask; a masked head emits a zero vector for every token (HEAD-MASK in the query-title BERT study).
Each module also has a `forward_packed` for inference without padding: the batch layout is
`model.packing`'s, and `model.kernels` can swap the linear layers for pre-packed oneDNN ones. The packed
forward computes the last layer for each pair's [CLS] only, since nothing else of it is read: exact, and
~14% of the encoder's multiply-adds saved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import BertConfig
from model.fused_attention import Rows, add_norm, packed_attention, parallel
from model.packing import Packing, pack, token_bucket

if TYPE_CHECKING:
    from model.onednn import OneDNNLinear  # swapped in by model.kernels, which builds on this module


def activation(name: str):
    if name == "gelu":
        return nn.GELU()
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return nn.GELU(approximate="tanh")
    if name == "relu":
        return nn.ReLU()
    raise ValueError(f"unsupported activation {name!r}")


@dataclass
class EncoderOutput:
    hidden: Tensor  # (B, T, H) last layer
    pooled: Tensor | None  # (B, H) tanh(dense([CLS])) when the model has a pooler
    attentions: list[Tensor] | None  # per layer (B, nh, T, T), plain path only


class Embeddings(nn.Module):
    """Word + position (+ segment) embeddings, normalised. The BERT-shaped architectures differ here only
    (model.arch): XLM-R's positions start at pad_token_id + 1 and it has one segment, DistilBERT none,
    ELECTRA's embeddings are narrower than its layers and projected up."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        e = cfg.embedding_width
        self.word = nn.Embedding(cfg.vocab_size, e, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, e)
        self.token_type = nn.Embedding(cfg.type_vocab_size, e) if cfg.type_vocab_size else None
        self.segments = cfg.type_vocab_size > 1  # one segment: every token is segment 0, whatever it is sent
        self.offset = cfg.position_offset
        self.norm = nn.LayerNorm(e, eps=cfg.layer_norm_eps)
        self.project = nn.Linear(e, cfg.hidden_size) if e != cfg.hidden_size else None
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def _sum(self, ids: Tensor, segments: Tensor, positions: Tensor) -> Tensor:
        x = self.word(ids) + self.position(positions + self.offset)
        if self.token_type is not None:
            x = x + (self.token_type(segments) if self.segments else self.token_type.weight[0])
        x = self.norm(x)
        return x if self.project is None else self.project(x)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.dropout(self._sum(input_ids, token_type_ids, pos))  # (B, T, H)

    def forward_packed(self, p: Packing) -> Tensor:
        """(N, H) for the packed tokens."""
        return self._sum(p.ids, p.segments, p.positions)


# In float32 arithmetic the fused kernel attends the pairs of at most this many tokens, longer ones per group
# (model.kernels.fused_max_tokens: its AMX and AVX512-BF16 paths take every pair). On a Zen 3
# (float32, one layer's attention) it ran 1.09x torch's flash kernel at 64 tokens, 0.93x at 256, 0.81x at 512:
# that kernel blocks long rows for the cache. On a Zen 4 the whole forward: 0.91x at 512 (bench/long_pairs.py).
FUSED_MAX_TOKENS = 192
# `math_attention` only on blocks of fewer keys: from 64 on, torch's flash kernel ran the whole bfloat16 forward
# 1.2-1.3x faster (2.2x at 512 tokens), below it 0.91-0.93x (AMD EPYC Zen 4, 1 and 2 threads; docs/benchmarks.md)
MATH_MAX_TOKENS = 63


def math_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
    """Attention as two matmuls in the inputs' precision around a float32 softmax. On the short blocks of
    the packed forward it beats torch's CPU flash kernel in bfloat16 where there is no AMX
    (`model.kernels.math_attention_pays`): that kernel's per-block set-up outweighs the work."""
    s = torch.matmul(q, k.transpose(-1, -2)).float()
    scale = q.shape[-1] ** -0.5
    s = s.mul_(scale) if bias is None else torch.add(bias, s, alpha=scale)
    return torch.matmul(s.softmax(-1).to(q.dtype), v)


class SelfAttention(nn.Module):
    """Multi-head self-attention over `len(heads)` heads (fewer than the config's after pruning)."""

    def __init__(self, cfg: BertConfig, heads: list[int]):
        super().__init__()
        self.heads = heads  # original head indices kept in this layer
        self.head_size = cfg.head_size
        inner = len(heads) * cfg.head_size
        self.query = nn.Linear(cfg.hidden_size, inner)
        self.key = nn.Linear(cfg.hidden_size, inner)
        self.value = nn.Linear(cfg.hidden_size, inner)
        # model.kernels.OneDNNLinear after model.kernels.use_onednn_linears() (which also deletes query, key and value)
        self.out: nn.Linear | OneDNNLinear = nn.Linear(inner, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.qkv: OneDNNLinear | nn.Linear | None = None  # fused q/k/v projection, set by model.kernels
        # Instead of qkv in the last layer (model.kernels): q for the [CLS] rows apart from k and v for every token
        self.cls_q: OneDNNLinear | nn.Linear | None = None
        self.cls_k: OneDNNLinear | nn.Linear | None = None
        self.cls_v: OneDNNLinear | nn.Linear | None = None
        # the packed forward's kernel, set by model.kernels: "fused" (model.fused_attention: one call over every
        # pair's rows in place) or a per-group one, `grouped`: "sdpa" (torch's) or "math"
        self.kernel = "sdpa"
        self.grouped = "sdpa"  # also where "fused" cannot run (several threads, autograd)
        self.fused_max = FUSED_MAX_TOKENS  # longer pairs attend per group (model.kernels sets it per path)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> Tensor:
        if self.grouped == "math" and k.shape[-2] <= MATH_MAX_TOKENS:
            return math_attention(q, k, v, bias)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def _fused(self) -> bool:
        # several threads only on torch's OpenMP team (fused_attention.parallel); no autograd through ctypes
        return self.kernel == "fused" and (torch.get_num_threads() == 1 or parallel()) and not torch.is_grad_enabled()

    def forward(
        self, x: Tensor, bias: Tensor, head_mask: Tensor | None, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        B, T, _ = x.shape
        nh, hs = len(self.heads), self.head_size
        if self.qkv is None and self.cls_q is None:
            q, k, v = self.query(x), self.key(x), self.value(x)
        else:
            q, k, v = self._project(x).split(nh * hs, dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)
        v = v.view(B, T, nh, hs).transpose(1, 2)
        drop = self.dropout_p if self.training else 0.0
        probs = None
        if return_probs:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(hs) + bias  # (B, nh, T, T)
            probs = scores.softmax(dim=-1)
            ctx = F.dropout(probs, drop, self.training) @ v
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=drop)
        if head_mask is not None:  # (nh,) zero silences a head entirely
            ctx = ctx * head_mask.view(1, nh, 1, 1).to(ctx.dtype)
        ctx = ctx.transpose(1, 2).reshape(B, T, nh * hs)
        return self.out(ctx), probs

    def _project(self, x: Tensor) -> Tensor:
        """q, k and v of `x`, concatenated along the last dimension, from whichever layers model.kernels left."""
        if self.qkv is not None:
            return self.qkv(x)
        return torch.cat(self._cls_projections(x, x), dim=-1)

    def _cls_projections(self, x: Tensor, x_cls: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q for `x_cls`, k and v for `x`: from cls_q, cls_k and cls_v where model.kernels split the last layer's
        projections so (k and v apart: their shape is the output layer's, whose oneDNN kernels are built anyway,
        where one k/v layer cost ~50 MB of kernels for its own shape), else from query, key and value."""
        if self.cls_q is not None and self.cls_k is not None and self.cls_v is not None:
            return self.cls_q(x_cls), self.cls_k(x), self.cls_v(x)
        return self.query(x_cls), self.key(x), self.value(x)

    def forward_cls(self, x: Tensor, bias: Tensor, head_mask: Tensor | None) -> Tensor:
        """The padded forward's attention output at [CLS] only (the last layer, when nothing else of it is
        read): x (B, T, H) -> (B, 1, H); keys and values still come from every token."""
        B, T, _ = x.shape
        nh, hs = len(self.heads), self.head_size
        q, k, v = self._cls_projections(x, x[:, :1])
        k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (k, v))
        ctx = F.scaled_dot_product_attention(q.view(B, 1, nh, hs).transpose(1, 2), k, v, attn_mask=bias)
        if head_mask is not None:
            ctx = ctx * head_mask.view(1, nh, 1, 1).to(ctx.dtype)
        return self.out(ctx.transpose(1, 2).reshape(B, 1, nh * hs))

    def forward_packed(self, x: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        """x: (N, H) packed tokens -> (N, H)."""
        return self.out(self.context_packed(self._project(x), p, head_mask))

    def context_packed(self, qkv: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        """qkv: (N, 3 * nh * hs) packed projections -> (N, nh * hs) context rows, before the output layer: the
        part the attention kernels differ in (model.kernels.attention_probe times it). Per group, on a
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

    def _grouped(self, qkv: Tensor, groups: list, head_mask: Tensor | None) -> list[Tensor]:
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
        return self.out(ctx)


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig, heads: list[int]):
        super().__init__()
        self.attn = SelfAttention(cfg, heads)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        # up and down: OneDNNLinear after model.kernels.use_onednn_linears()
        self.up: nn.Linear | OneDNNLinear = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act_name = cfg.hidden_act
        self.act = activation(cfg.hidden_act)
        self.down: nn.Linear | OneDNNLinear = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.fused_norm = False  # the packed forward's add + norm in one pass (model.kernels.use_fused_norms)

    def forward(
        self, x: Tensor, bias: Tensor, head_mask: Tensor | None, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, H), bias: (B, 1, 1, T) -> (B, T, H) and, on request, the (B, nh, T, T) probabilities."""
        a, probs = self.attn(x, bias, head_mask, return_probs)
        x = self.attn_norm(x + self.dropout(a))  # post-norm, as in BERT
        x = self.ffn_norm(x + self.dropout(self.down(self.act(self.up(x)))))
        return x, probs

    def forward_cls(self, x: Tensor, bias: Tensor, head_mask: Tensor | None) -> Tensor:
        """x: (B, T, H) -> (B, 1, H), this layer's output at [CLS] only."""
        h = self.attn_norm(x[:, :1] + self.dropout(self.attn.forward_cls(x, bias, head_mask)))
        return self.ffn_norm(h + self.dropout(self.down(self.act(self.up(h)))))

    def forward_packed(self, x: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        """x: (N, H) packed tokens -> (N, H)."""
        x = add_norm(self.attn_norm, x, self.attn.forward_packed(x, p, head_mask), self.fused_norm)
        return add_norm(self.ffn_norm, x, self.down(self.act(self.up(x))), self.fused_norm)

    def forward_packed_cls(self, x: Tensor, p: Packing, rows: Tensor, head_mask: Tensor | None) -> Tensor:
        """x: (N, H) packed tokens -> (M, H), this layer's output at `rows` (the [CLS] rows) only."""
        a = self.attn.forward_packed_cls(x, p, rows, head_mask)
        h = add_norm(self.attn_norm, x.index_select(0, rows), a, self.fused_norm)
        return add_norm(self.ffn_norm, h, self.down(self.act(self.up(h))), self.fused_norm)


class Pooler(nn.Module):
    """BERT's pooler, and the dense layer of XLM-R's, ELECTRA's and DistilBERT's heads: act(dense([CLS]))."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = nn.Tanh() if cfg.pooler_act == "tanh" else activation(cfg.pooler_act)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.pool(hidden[:, 0])  # (B, T, H) -> (B, H), from [CLS]

    def pool(self, cls: Tensor) -> Tensor:
        return self.act(self.dense(cls))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig, with_pooler: bool = True):
        super().__init__()
        self.cfg = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Layer(cfg, cfg.heads_in_layer(i)) for i in range(cfg.num_hidden_layers))
        self.pooler = Pooler(cfg) if with_pooler else None

    def forward(
        self,
        input_ids: Tensor,  # (B, T)
        token_type_ids: Tensor,  # (B, T)
        attention_mask: Tensor,  # (B, T) 1 = token, 0 = padding
        head_mask: Tensor | None = None,  # (layers, config heads), original head indices
        output_attentions: bool = False,
        cls_only: bool = False,
    ) -> EncoderOutput:
        """`cls_only`: the last layer at [CLS] only (`hidden` is then (B, 1, H)): what scoring reads, and
        ~14% fewer multiply-adds. Not with `output_attentions`, which needs every token's probabilities."""
        x = self.embeddings(input_ids, token_type_ids)
        # (B, 1, 1, T) additive bias: padded keys get the dtype's minimum, as transformers does.
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        attentions: list[Tensor] | None = [] if output_attentions else None
        self._check_head_mask(head_mask)
        cls_only = cls_only and not output_attentions
        for i, layer in enumerate(self.blocks):
            hm = None if head_mask is None else head_mask[i, layer.attn.heads].to(x.device)
            if cls_only and i == len(self.layers) - 1:
                x = layer.forward_cls(x, bias, hm)
                continue
            x, probs = layer(x, bias, hm, output_attentions)
            if attentions is not None:
                attentions.append(probs)
        pooled = self.pooler(x) if self.pooler is not None else None
        return EncoderOutput(hidden=x, pooled=pooled, attentions=attentions)

    @property
    def blocks(self) -> list[Layer]:
        """`layers`, typed: to a type checker an nn.ModuleList holds plain Modules."""
        return cast("list[Layer]", list(self.layers))

    def _check_head_mask(self, head_mask: Tensor | None) -> None:
        want = (self.cfg.num_hidden_layers, self.cfg.num_attention_heads)
        if head_mask is not None and tuple(head_mask.shape) != want:
            raise ValueError(f"head_mask must have shape {want}, got {tuple(head_mask.shape)}")

    def forward_packed(self, p: Packing, head_mask: Tensor | None = None) -> Tensor:
        """Inference without padding -> (B, H): the pooled [CLS] (or the raw [CLS] without a pooler),
        in packed order."""
        self._check_head_mask(head_mask)
        x = self.embeddings.forward_packed(p)
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


class BertForRelevance(nn.Module):
    """Encoder + the graded-relevance head over [CLS] (through the pooler when there is one)."""

    def __init__(self, cfg: BertConfig, with_pooler: bool = True):
        super().__init__()
        self.cfg = cfg
        self.bert = BertEncoder(cfg, with_pooler)
        p = cfg.classifier_dropout if cfg.classifier_dropout is not None else cfg.hidden_dropout_prob
        self.dropout = nn.Dropout(p)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor,
        attention_mask: Tensor,
        head_mask: Tensor | None = None,
        output_attentions: bool = False,
        cls_only: bool = False,
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Returns logits (B, num_labels) and, on request, per-layer attention probabilities. `cls_only`:
        the last layer at [CLS] only (inference; see BertEncoder.forward)."""
        out = self.bert(input_ids, token_type_ids, attention_mask, head_mask, output_attentions, cls_only)
        cls = out.pooled if out.pooled is not None else out.hidden[:, 0]
        return self.classifier(self.dropout(cls)), out.attentions

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

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """BERT's initialisation (normal(0, 0.02), zero bias, unit LayerNorm), reproducible by seed."""
        g = torch.Generator().manual_seed(seed)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
