"""ModernBERT in plain PyTorch: pre-norm layers without biases, rotary positions, a GeGLU feed-forward,
and attention that alternates between global layers and local ones, where a token sees only the tokens
within half the window (`local_attention // 2`) on either side; a final norm, then the head: dense ->
activation -> norm over [CLS] (or the mean of the tokens), and the classifier.

This is the reference forward, on padded batches (`scaled_dot_product_attention`, or materialised
probabilities when they are asked for); the fast CPU path without padding is model.engines.modern_packed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.bert import activation
from model.config import BertConfig


@dataclass(frozen=True)
class ModernBertConfig(BertConfig):
    """BertConfig's fields (hidden_act is ModernBERT's hidden_activation, layer_norm_eps its norm_eps,
    pooler_act its classifier_activation) and ModernBERT's own."""

    local_attention: int = 128  # the local layers' window: a token sees local_attention // 2 on either side
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" or "sliding_attention"
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    classifier_bias: bool = False  # the head's dense layer (the classifier always has one)
    classifier_pooling: str = "cls"  # or "mean" over the pair's tokens

    def is_local(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"


def _norm(cfg: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


def rotary(positions: Tensor, head_size: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin (T, hs) of the rotary angles, rounded to `dtype` as transformers does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, nh, T, hs) rotated by its positions' angles, in float32."""
    half = x.shape[-1] // 2
    xf = x.float()
    turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + turned * sin).to(x.dtype)


class Layer(nn.Module):
    def __init__(self, cfg: ModernBertConfig, index: int):
        super().__init__()
        h = cfg.hidden_size
        self.heads, self.head_size = cfg.num_attention_heads, cfg.head_size
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else _norm(cfg)  # the embeddings' norm serves
        self.qkv = nn.Linear(h, 3 * h, bias=cfg.attention_bias)
        self.out = nn.Linear(h, h, bias=cfg.attention_bias)
        self.mlp_norm = _norm(cfg)
        self.up = nn.Linear(h, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)  # GeGLU: input and gate
        self.act = activation(cfg.hidden_act)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.local = cfg.is_local(index)
        self.theta = cfg.local_rope_theta if self.local else cfg.global_rope_theta

    def attend(
        self, x: Tensor, bias: Tensor, rope: tuple[Tensor, Tensor], head_mask: Tensor | None, probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        B, T, _ = x.shape
        nh, hs = self.heads, self.head_size
        q, k, v = self.qkv(x).view(B, T, 3, nh, hs).permute(2, 0, 3, 1, 4)  # each (B, nh, T, hs)
        q, k = rotate(q, *rope), rotate(k, *rope)
        p = None
        if probs:
            p = (torch.matmul(q, k.transpose(-1, -2)) * hs**-0.5 + bias).softmax(-1, dtype=torch.float32)
            ctx = torch.matmul(p.to(q.dtype), v)
        else:
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        if head_mask is not None:  # (nh,) zero silences a head
            ctx = ctx * head_mask.view(1, nh, 1, 1).to(ctx.dtype)
        return self.out(ctx.transpose(1, 2).reshape(B, T, nh * hs)), p

    def forward(
        self, x: Tensor, bias: Tensor, rope: tuple[Tensor, Tensor], head_mask: Tensor | None, probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, H) -> (B, T, H), pre-norm residual blocks; on request the (B, nh, T, T) probabilities."""
        a, p = self.attend(self.attn_norm(x), bias, rope, head_mask, probs)
        x = x + a
        gate_in, gate = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(self.act(gate_in) * gate), p


class Encoder(nn.Module):
    def __init__(self, cfg: ModernBertConfig):
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.embed_norm = _norm(cfg)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_norm = _norm(cfg)

    @property
    def blocks(self) -> list[Layer]:
        return cast("list[Layer]", list(self.layers))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, head_mask: Tensor | None, output_attentions: bool
    ) -> tuple[Tensor, list[Tensor] | None]:
        """(B, T) ids and mask -> (B, T, H) final hidden states and, on request, each layer's probabilities."""
        x = self.embed_norm(self.word(input_ids))
        T, dtype = input_ids.shape[1], x.dtype
        keys = attention_mask[:, None, None, :].bool()  # (B, 1, 1, T)
        pos = torch.arange(T, device=x.device)
        near = (pos[None, :] - pos[:, None]).abs() <= self.cfg.local_attention // 2  # (T, T)
        lowest = torch.finfo(dtype).min
        full = torch.zeros(keys.shape, dtype=dtype, device=x.device).masked_fill(~keys, lowest)
        window = torch.zeros((*keys.shape[:2], T, T), dtype=dtype, device=x.device).masked_fill(~(keys & near), lowest)
        hs = self.cfg.head_size
        ropes = {th: rotary(pos, hs, th, dtype) for th in {b.theta for b in self.blocks}}
        attentions: list[Tensor] | None = [] if output_attentions else None
        for i, layer in enumerate(self.blocks):
            hm = None if head_mask is None else head_mask[i].to(x.device)
            x, p = layer(x, window if layer.local else full, ropes[layer.theta], hm, output_attentions)
            if attentions is not None and p is not None:
                attentions.append(p)
        return self.final_norm(x), attentions


class ModernBertForRelevance(nn.Module):
    """Encoder + ModernBERT's head (dense -> activation -> norm) + the classifier."""

    def __init__(self, cfg: ModernBertConfig, with_pooler: bool = True):
        super().__init__()
        del with_pooler  # ModernBERT's head always has its dense layer
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.head_act = activation(cfg.pooler_act) if cfg.pooler_act != "tanh" else nn.Tanh()
        self.head_norm = _norm(cfg)
        self.dropout = nn.Dropout(cfg.classifier_dropout or 0.0)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)

    def forward(
        self,
        input_ids: Tensor,
        token_type_ids: Tensor,  # unused: ModernBERT has no segments
        attention_mask: Tensor,
        head_mask: Tensor | None = None,  # (layers, heads)
        output_attentions: bool = False,
        cls_only: bool = False,  # accepted for RelevanceModel's contract; every token is computed
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Logits (B, num_labels) and, on request, per-layer attention probabilities."""
        del token_type_ids, cls_only
        want = (self.cfg.num_hidden_layers, self.cfg.num_attention_heads)
        if head_mask is not None and tuple(head_mask.shape) != want:
            raise ValueError(f"head_mask must have shape {want}, got {tuple(head_mask.shape)}")
        hidden, attentions = self.encoder(input_ids, attention_mask, head_mask, output_attentions)
        if self.cfg.classifier_pooling == "mean":
            m = attention_mask[:, :, None].to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
        else:
            pooled = hidden[:, 0]
        pooled = self.head_norm(self.head_act(self.dense(pooled)))
        return self.classifier(self.dropout(pooled)), attentions

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """normal(0, std) weights, zero biases, unit norms, reproducible by seed."""
        g = torch.Generator().manual_seed(seed)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                with torch.no_grad():
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
                if isinstance(m, nn.Linear) and m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
