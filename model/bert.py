"""BERT encoder in plain PyTorch: embeddings, post-norm attention + feed-forward layers, pooler.

Two attention paths share the same weights: a fast one through `scaled_dot_product_attention`, and a
plain one that materialises the (B, nh, T, T) probabilities so they can be returned. Both take a head
mask; a masked head emits a zero vector for every token (HEAD-MASK in the query-title BERT study).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import BertConfig


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


@dataclass
class AttentionGroup:
    """Pairs of similar length that attend as one padded (b, t) block."""

    gather: Tensor  # (b*t,) packed row behind each slot of the block; padding slots repeat a real row
    real: Tensor | None  # (n,) the block's slots that hold real tokens, in packed order; None if no padding
    bias: Tensor | None  # (b, 1, 1, t) additive key mask; None if no padding
    b: int
    t: int


@dataclass
class Packing:
    """A batch of variable-length pairs laid out without padding: the N real tokens of all pairs, longest
    pair first. Embeddings, projections, feed-forward and norms run on (N, H); only attention needs
    blocks, and it gets them per group of similar length (see `pack`)."""

    order: Tensor  # (B,) batch index of each packed pair
    ids: Tensor  # (N,)
    segments: Tensor  # (N,)
    positions: Tensor  # (N,)
    cls: Tensor  # (B,) packed row of each packed pair's first token
    groups: list[AttentionGroup]
    spare: int = 0  # filler rows after the real tokens (see token_bucket)


def token_bucket(n: int) -> int:
    """`n` rounded up to a short ladder of sizes (at most 1/8 more, ~70 sizes up to 8192 tokens).
    oneDNN builds a kernel per new input shape of a linear layer: ~9 ms each in bfloat16 on this CPU,
    more than a whole small batch takes. With the packed token count on this ladder, every shape a
    server meets can be built once at warm-up (see `warm_linear_shapes`)."""
    granule = 16 if n <= 256 else 32 if n <= 1024 else 128 if n <= 4096 else 512
    return -(-n // granule) * granule


def token_buckets(max_tokens: int) -> list[int]:
    out, n = [], 1
    while True:
        b = token_bucket(n)
        out.append(b)
        if b >= max_tokens:
            return out
        n = b + 1


def pack(
    input_ids: list[list[int]], token_type_ids: list[list[int]], device: torch.device, dtype: torch.dtype,
    ratio: float = 0.8,
) -> Packing:
    """Pack a batch; consecutive pairs (by length, longest first) share an attention block while their
    length is at least `ratio` of the block's longest, so a block is at most ~1/ratio padded.
    Padding costs twice on CPU: in the service's batches of concurrent one-pair requests, 30-40% of the
    padded tokens were padding, and attention took a third of the forward (docs/design.md)."""
    lengths = [len(x) for x in input_ids]
    if not lengths or min(lengths) == 0:
        raise ValueError("every pair needs at least one token")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    lens = [lengths[i] for i in order]
    flat_ids = [t for i in order for t in input_ids[i]]
    flat_seg = [t for i in order for t in token_type_ids[i]]
    starts, acc = [], 0
    for n in lens:
        starts.append(acc)
        acc += n
    spare = token_bucket(acc) - acc  # filler rows: computed by the linear layers, never attended to or read
    flat_ids += [0] * spare
    flat_seg += [0] * spare
    positions = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(spare, dtype=torch.long)])
    groups = []
    i = 0
    while i < len(lens):
        t, j = lens[i], i
        while j < len(lens) and lens[j] >= ratio * t:
            j += 1
        gl = torch.tensor(lens[i:j])
        gs = torch.tensor(starts[i:j])
        slots = torch.arange(t)[None, :]  # (1, t)
        keep = slots < gl[:, None]  # (b, t)
        gather = torch.minimum(gs[:, None] + slots, (gs + gl - 1)[:, None]).reshape(-1)
        if bool(keep.all()):
            real, bias = None, None
        else:
            real = keep.reshape(-1).nonzero().squeeze(1).to(device)
            bias = torch.zeros(j - i, 1, 1, t, dtype=dtype).masked_fill(~keep[:, None, None, :], torch.finfo(dtype).min)
            bias = bias.to(device)
        groups.append(AttentionGroup(gather.to(device), real, bias, j - i, t))
        i = j
    return Packing(
        order=torch.tensor(order, device=device),
        ids=torch.tensor(flat_ids, device=device),
        segments=torch.tensor(flat_seg, device=device),
        positions=positions.to(device),
        cls=torch.tensor(starts, device=device),
        groups=groups,
        spare=spare,
    )


@torch.inference_mode()
def warm_linear_shapes(module: nn.Module, max_tokens: int) -> int:
    """Run every distinct linear layer of the encoder once per token bucket up to `max_tokens`, so that
    oneDNN's kernels for those shapes exist before the first request. Returns the shapes warmed."""
    seen: dict[tuple, tuple[nn.Module, int]] = {}
    for m in module.modules():
        if isinstance(m, Layer):
            a = m.attn
            for lin in ([a.qkv] if a.qkv is not None else [a.query, a.key, a.value]) + [a.out, m.up, m.down]:
                fan_in = lin.weight_in if isinstance(lin, PackedLinear) else lin.in_features
                seen.setdefault((type(lin), fan_in, lin.out_features, getattr(lin, "act", None)), (lin, fan_in))
    ref = module.bert.embeddings.word.weight
    for n in token_buckets(max_tokens):
        for lin, fan_in in seen.values():
            lin(torch.zeros(n, fan_in, dtype=ref.dtype, device=ref.device))
    return len(seen) * len(token_buckets(max_tokens))


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        x = self.word(input_ids) + self.token_type(token_type_ids) + self.position(pos)[None]
        return self.dropout(self.norm(x))

    def forward_packed(self, p: Packing) -> Tensor:
        """(N, H) for the packed tokens."""
        return self.norm(self.word(p.ids) + self.token_type(p.segments) + self.position(p.positions))


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
        self.out = nn.Linear(inner, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.qkv: nn.Module | None = None  # fused q/k/v projection, set by pack_for_cpu() for inference

    def forward(
        self, x: Tensor, bias: Tensor, head_mask: Tensor | None, return_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        B, T, _ = x.shape
        nh, hs = len(self.heads), self.head_size
        if self.qkv is not None:
            q, k, v = self.qkv(x).split(nh * hs, dim=-1)
        else:
            q, k, v = self.query(x), self.key(x), self.value(x)
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

    def forward_packed(self, x: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        """x: (N, H) packed tokens -> (N, H). Attention runs per group on a (b, nh, t, hs) block."""
        nh, hs = len(self.heads), self.head_size
        if self.qkv is not None:
            qkv = self.qkv(x)  # (N, 3 * nh * hs)
        else:
            qkv = torch.cat([self.query(x), self.key(x), self.value(x)], dim=-1)
        parts = []
        for g in p.groups:
            q, k, v = qkv.index_select(0, g.gather).view(g.b, g.t, 3, nh, hs).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=g.bias)  # (b, nh, t, hs)
            if head_mask is not None:
                ctx = ctx * head_mask.view(1, nh, 1, 1).to(ctx.dtype)
            ctx = ctx.transpose(1, 2).reshape(g.b * g.t, nh * hs)
            parts.append(ctx if g.real is None else ctx.index_select(0, g.real))
        if p.spare:
            parts.append(qkv.new_zeros(p.spare, nh * hs))
        return self.out(torch.cat(parts) if len(parts) > 1 else parts[0])


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


@torch.no_grad()
def pack_for_cpu(model: nn.Module) -> None:
    """Swap the encoder's linear layers for pre-packed oneDNN ones (fused q/k/v, GELU fused into the
    feed-forward's first matmul). Inference only: packed weights are not trained or saved."""
    for layer in model.modules():
        if not isinstance(layer, Layer):
            continue
        a = layer.attn
        a.qkv = PackedLinear(torch.cat([a.query.weight, a.key.weight, a.value.weight]),
                             torch.cat([a.query.bias, a.key.bias, a.value.bias]))
        a.out = PackedLinear(a.out.weight, a.out.bias)
        del a.query, a.key, a.value
        fused = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}.get(layer.act_name)
        if fused is not None:
            layer.up = PackedLinear(layer.up.weight, layer.up.bias, "gelu", fused)
            layer.act = nn.Identity()
        else:
            layer.up = PackedLinear(layer.up.weight, layer.up.bias)
        layer.down = PackedLinear(layer.down.weight, layer.down.bias)


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig, heads: list[int]):
        super().__init__()
        self.attn = SelfAttention(cfg, heads)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act_name = cfg.hidden_act
        self.act = activation(cfg.hidden_act)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, x, bias, head_mask, return_probs):
        a, probs = self.attn(x, bias, head_mask, return_probs)
        x = self.attn_norm(x + self.dropout(a))  # post-norm, as in BERT
        x = self.ffn_norm(x + self.dropout(self.down(self.act(self.up(x)))))
        return x, probs

    def forward_packed(self, x: Tensor, p: Packing, head_mask: Tensor | None) -> Tensor:
        x = self.attn_norm(x + self.attn.forward_packed(x, p, head_mask))
        return self.ffn_norm(x + self.down(self.act(self.up(x))))


class Pooler(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


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
    ) -> EncoderOutput:
        x = self.embeddings(input_ids, token_type_ids)
        # (B, 1, 1, T) additive bias: padded keys get the dtype's minimum, as transformers does.
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        attentions: list[Tensor] | None = [] if output_attentions else None
        self._check_head_mask(head_mask)
        for i, layer in enumerate(self.layers):
            hm = None if head_mask is None else head_mask[i, layer.attn.heads].to(x.device)
            x, probs = layer(x, bias, hm, output_attentions)
            if attentions is not None:
                attentions.append(probs)
        pooled = self.pooler(x) if self.pooler is not None else None
        return EncoderOutput(hidden=x, pooled=pooled, attentions=attentions)

    def _check_head_mask(self, head_mask: Tensor | None) -> None:
        want = (self.cfg.num_hidden_layers, self.cfg.num_attention_heads)
        if head_mask is not None and tuple(head_mask.shape) != want:
            raise ValueError(f"head_mask must have shape {want}, got {tuple(head_mask.shape)}")

    def forward_packed(self, p: Packing, head_mask: Tensor | None = None) -> Tensor:
        """Inference without padding -> (B, H): the pooled [CLS] (or the raw [CLS] without a pooler),
        in packed order."""
        self._check_head_mask(head_mask)
        x = self.embeddings.forward_packed(p)
        for i, layer in enumerate(self.layers):
            hm = None if head_mask is None else head_mask[i, layer.attn.heads].to(x.device)
            x = layer.forward_packed(x, p, hm)
        cls = x.index_select(0, p.cls)
        return torch.tanh(self.pooler.dense(cls)) if self.pooler is not None else cls


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
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Returns logits (B, num_labels) and, on request, per-layer attention probabilities."""
        out = self.bert(input_ids, token_type_ids, attention_mask, head_mask, output_attentions)
        cls = out.pooled if out.pooled is not None else out.hidden[:, 0]
        return self.classifier(self.dropout(cls)), out.attentions

    def forward_packed(
        self, input_ids: list[list[int]], token_type_ids: list[list[int]], head_mask: Tensor | None = None
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
