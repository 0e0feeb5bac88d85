"""BERT encoder in plain PyTorch: embeddings, post-norm attention + feed-forward layers, pooler.

This is the reference model: what training runs, what the checkpoints hold, and what every fast path is
tested against. Attention has two paths over the same weights: torch's `scaled_dot_product_attention`, and a
plain one that materialises the (B, nh, T, T) probabilities so they can be returned. Both take a head mask;
a masked head emits a zero vector for every token (HEAD-MASK in the query-title BERT study).

The inference engines (`model.engines`) build on these classes: the packed forward without padding, the
kernels and OpenVINO live there, chosen once when a model is loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import BertConfig


def activation(name: str) -> nn.Module:
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

    def sum(self, ids: Tensor, segments: Tensor, positions: Tensor) -> Tensor:
        """(..., H) embeddings of these token ids at these segments and positions (0-based in their pair)."""
        x = self.word(ids) + self.position(positions + self.offset)
        if self.token_type is not None:
            x = x + (self.token_type(segments) if self.segments else self.token_type.weight[0])
        x = self.norm(x)
        return x if self.project is None else self.project(x)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.dropout(self.sum(input_ids, token_type_ids, pos))  # (B, T, H)


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
        self.out: nn.Module = nn.Linear(inner, cfg.hidden_size)  # an engine may swap in a faster layer
        self.dropout_p = cfg.attention_probs_dropout_prob

    def project(self, x: Tensor, x_cls: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q for `x_cls`, k and v for `x` (an engine's attention may hold them fused)."""
        return self.query(x_cls), self.key(x), self.value(x)

    def forward(
        self, x: Tensor, bias: Tensor, head_mask: Tensor | None, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        B, T, _ = x.shape
        nh, hs = len(self.heads), self.head_size
        q, k, v = self.project(x, x)
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

    def forward_cls(self, x: Tensor, bias: Tensor, head_mask: Tensor | None) -> Tensor:
        """The attention output at [CLS] only (the last layer, when nothing else of it is read):
        x (B, T, H) -> (B, 1, H); keys and values still come from every token."""
        B, T, _ = x.shape
        nh, hs = len(self.heads), self.head_size
        q, k, v = self.project(x, x[:, :1])
        k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (k, v))
        ctx = F.scaled_dot_product_attention(q.view(B, 1, nh, hs).transpose(1, 2), k, v, attn_mask=bias)
        if head_mask is not None:
            ctx = ctx * head_mask.view(1, nh, 1, 1).to(ctx.dtype)
        return self.out(ctx.transpose(1, 2).reshape(B, 1, nh * hs))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig, heads: list[int]):
        super().__init__()
        self.attn = SelfAttention(cfg, heads)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.up: nn.Module = nn.Linear(cfg.hidden_size, cfg.intermediate_size)  # up and down: an engine may swap
        self.act_name = cfg.hidden_act
        self.act = activation(cfg.hidden_act)
        self.down: nn.Module = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

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
        self.check_head_mask(head_mask)
        cls_only = cls_only and not output_attentions
        for i, layer in enumerate(self.blocks):
            hm = None if head_mask is None else head_mask[i, layer.attn.heads].to(x.device)
            if cls_only and i == len(self.layers) - 1:
                x = layer.forward_cls(x, bias, hm)
                continue
            x, probs = layer(x, bias, hm, output_attentions)
            if attentions is not None and probs is not None:
                attentions.append(probs)
        pooled = self.pooler(x) if self.pooler is not None else None
        return EncoderOutput(hidden=x, pooled=pooled, attentions=attentions)

    @property
    def blocks(self) -> list[Layer]:
        """`layers`, typed: to a type checker an nn.ModuleList holds plain Modules."""
        return cast("list[Layer]", list(self.layers))

    def check_head_mask(self, head_mask: Tensor | None) -> None:
        want = (self.cfg.num_hidden_layers, self.cfg.num_attention_heads)
        if head_mask is not None and tuple(head_mask.shape) != want:
            raise ValueError(f"head_mask must have shape {want}, got {tuple(head_mask.shape)}")


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
