"""ModernBERT's fast CPU path: batches without padding (`model.packing`), the linear layers pre-packed for
oneDNN where they pay (model.kernels.onednn_pays and its probe), and attention by the fused C kernel
(model.engines.fused, BERT's): rotary positions applied in place on the packed q and k rows right after their
projection (`rotary_rows`, probed at load against torch's ops, which serve where it is missing or differs),
then each pair's rows attended where they lie; a local layer's window is the whole pair where the pair fits
in it, and a key range per query row where it does not, so no mask and no copy either way. Where the fused
kernel cannot run (not built, several threads without OpenMP, autograd) attention goes per group of pairs
of similar length, the window laid over each group's key mask. The last norm, the pooling and the head run on
each pair's rows. Equal to ModernBertForRelevance's padded forward (float32: to ~1e-6)."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.arch import Network
from model.engines import fused
from model.engines.base import EngineKind, Ids, Kernels
from model.engines.fused import Rows, packed_attention, rotary_rows
from model.engines.kernels import onednn_available, onednn_pays, per_group_attention, probe
from model.engines.onednn import OneDNNGeGLU, OneDNNLinear, geglu_probe
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
        self.kernel = self.grouped  # or "fused" (modern_engine): the C kernel attends every pair in place
        self.rope_kernel = False  # rotary in place by the C kernel (probed by modern_engine), else torch's ops
        self._tables: dict[tuple[float, int, torch.dtype], Tensor] = {}
        # the last layer's q for the [CLS] rows apart from k and v for every row (split_last_projection)
        self.last_q: nn.Module | None = None
        self.last_k: nn.Module | None = None
        self.last_v: nn.Module | None = None
        # per layer, its up projection, activation and gate in one oneDNN module (install_linears), or None
        self.geglu: nn.ModuleList | None = None
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
        in_place = self._fused()
        for i, layer in enumerate(enc.blocks):
            hm = None if head_mask is None else head_mask[i].to(x.device)
            cls = i == last and cls_only  # nothing but [CLS] is read of the last layer: exact, and less work
            if cls and in_place and self.last_q is not None:
                x, ctx = self._attend_cls(layer, x, p, rows, hm)
            else:
                qkv = layer.qkv(layer.attn_norm(x))
                ctx = (
                    self._attend_in_place(layer, qkv, p, hm, cls)
                    if in_place
                    else self._attend(layer, qkv, p, ropes, hm)
                )
                if cls:
                    x, ctx = x.index_select(0, rows), ctx.index_select(0, rows)
            x = x + layer.out(ctx)
            if self.geglu is not None:
                x = x + layer.down(self.geglu[i](layer.mlp_norm(x)))
            else:
                gate_in, gate = layer.up(layer.mlp_norm(x)).chunk(2, dim=-1)
                x = x + layer.down(layer.act(gate_in).mul_(gate))
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

    def _fused(self) -> bool:
        # several threads only on torch's OpenMP team (fused.parallel); no autograd through ctypes
        one = torch.get_num_threads() == 1 or fused.parallel()
        return self.kernel == "fused" and one and not torch.is_grad_enabled()

    def _attend_in_place(self, layer: Layer, qkv: Tensor, p: Packing, head_mask: Tensor | None, cls: bool) -> Tensor:
        """(N, 3H) packed projections -> (N, H) context rows by the fused kernel, q and k turned in place first;
        `cls`: the [CLS] rows' only (the others left unwritten), filler rows zero."""
        nh, hs = layer.heads, layer.head_size
        w = nh * hs
        self.rotate(layer, qkv, p)
        ctx = qkv.new_zeros(len(qkv), w) if p.spare else qkv.new_empty(len(qkv), w)
        at = p.starts if cls else None
        rows = p.memo(f"modern rows {layer.local} {cls}", lambda: self._rows(p, layer.local, at))
        q, k, v = qkv[:, :w], qkv[:, w : 2 * w], qkv[:, 2 * w :]
        return packed_attention(q, k, v, ctx, rows, nh, hs, head_mask, exact=True)  # pre-norm: float32 arithmetic

    def _attend_cls(
        self, layer: Layer, x: Tensor, p: Packing, rows: Tensor, head_mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The last layer's attention for the [CLS] rows only: their q (at position 0, which rotary leaves as it
        is), k and v of every row -> (x at `rows`, the context rows of `rows`)."""
        assert self.last_q is not None and self.last_k is not None and self.last_v is not None
        nh, hs = layer.heads, layer.head_size
        h = layer.attn_norm(x)
        q, k, v = self.last_q(h.index_select(0, rows)), self.last_k(h), self.last_v(h)
        self.rotate(layer, k, p, nh)
        ctx = q.new_zeros(len(q), nh * hs)  # rows past the pairs' (bucket filler) stay zero
        first = np.arange(len(p.lengths))
        cls = p.memo(f"modern cls rows {layer.local}", lambda: self._rows(p, layer.local, first))
        return x.index_select(0, rows), packed_attention(q, k, v, ctx, cls, nh, hs, head_mask, exact=True)

    def rotate(self, layer: Layer, t: Tensor, p: Packing, heads: int | None = None) -> None:
        """Rotary positions on the first `heads` heads (default: q's and k's) of packed rows, in place."""
        nh, hs = heads or 2 * layer.heads, layer.head_size
        table = self._table(layer.theta, hs, t.dtype, int(p.lengths[0]))  # packed longest first
        if self.rope_kernel:
            rotary_rows(t, p.positions, table, nh, hs)
            return
        cos, sin = table[p.positions].split(hs, dim=-1)  # (N, hs) each
        qk = t[:, : nh * hs].unflatten(1, (nh, hs))
        xf, half = qk.float(), hs // 2
        turned = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        qk.copy_(xf * cos[:, None] + turned * sin[:, None])

    def _table(self, theta: float, hs: int, dtype: torch.dtype, longest: int) -> Tensor:
        """float32 (positions, 2 * hs): cos then sin of each position's angles, rounded to `dtype` as the
        reference does; grown to a power of two as longer pairs come."""
        key = (theta, hs, dtype)
        t = self._tables.get(key)
        if t is None or len(t) < longest:
            cos, sin = rotary(torch.arange(max(256, 1 << (longest - 1).bit_length())), hs, theta, dtype)
            t = self._tables[key] = torch.cat((cos, sin), dim=-1).float().contiguous()
        return t

    def _rows(self, p: Packing, local: bool, cls_at: np.ndarray | None = None) -> Rows:
        """Which key rows each query row attends to: a pair's own rows; in a local layer, for a pair longer than
        the window can hold, each query row's window (keys within half the window), one entry per row.
        `cls_at`: the [CLS] queries only, pair i's at row cls_at[i] of q."""
        starts, lengths, half = p.starts, p.lengths, self.cfg.local_attention // 2
        klen = np.minimum(lengths, half + 1) if local else lengths
        if cls_at is not None:  # one query each, at position 0: its window starts at the pair's first row
            return Rows(cls_at, np.ones_like(lengths), starts, klen)
        n = p.longer_than(half + 1) if local else 0  # packed longest first: pairs 0 .. n - 1 need windows
        if n == 0:
            return Rows(starts, lengths, starts, lengths)
        pos = np.concatenate([np.arange(length) for length in lengths[:n]])
        length = np.repeat(lengths[:n], lengths[:n])
        lo, hi = np.maximum(pos - half, 0), np.minimum(pos + half + 1, length)
        first = np.repeat(starts[:n], lengths[:n])
        return Rows(
            np.concatenate([first + pos, starts[n:]]),
            np.concatenate([np.ones_like(pos), lengths[n:]]),
            np.concatenate([first + lo, starts[n:]]),
            np.concatenate([hi - lo, lengths[n:]]),
        )

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


def _linears(module: PackedModernBert) -> list[tuple[nn.Module, str]]:
    own: list[tuple[nn.Module, str]] = [
        (layer, n) for layer in module.encoder.blocks for n in ("qkv", "out", "up", "down")
    ]
    return own + [(module, n) for n in ("last_q", "last_k", "last_v") if getattr(module, n) is not None]


@torch.no_grad()
def split_last_projection(module: PackedModernBert) -> None:
    """Give the last layer q, k and v projections of their own (as BERT's packed path does): q then runs on
    the [CLS] rows alone, a third of that layer's projection saved; each has the output layer's shape, whose
    oneDNN kernels are built anyway. Only the fused path with [CLS] pooling uses them."""
    layer = module.encoder.blocks[-1]
    lin = layer.qkv
    w = layer.heads * layer.head_size
    for i, name in enumerate(("last_q", "last_k", "last_v")):
        part = nn.Linear(lin.in_features, w, bias=lin.bias is not None, dtype=lin.weight.dtype)
        part.weight.copy_(lin.weight[i * w : (i + 1) * w])
        if lin.bias is not None:
            part.bias.copy_(lin.bias[i * w : (i + 1) * w])
        setattr(module, name, part.requires_grad_(False))


@torch.no_grad()
def install_linears(module: PackedModernBert, dtype: torch.dtype) -> str:
    """oneDNN's pre-packed linear layers where they pay and the probe passes, as model.kernels does for BERT;
    say which layers run ("onednn-packed", "plain", "plain (probe failed: ...)")."""
    if not onednn_available(dtype) or not onednn_pays(dtype):
        return "plain"
    failure = probe(dtype)
    if failure is not None:
        return f"plain (probe failed: {failure})"
    gelu = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}.get(module.cfg.hidden_act)
    if gelu is not None and geglu_probe(dtype) is None:  # GeGLU in the up projection's kernels
        ups = [layer.up for layer in module.encoder.blocks]
        module.geglu = nn.ModuleList(OneDNNGeGLU(up.weight, _bias(up), gelu) for up in ups)
    for layer, name in _linears(module):
        if name == "up" and module.geglu is not None:
            continue  # the GeGLU modules hold its weights
        lin = cast(nn.Linear, getattr(layer, name))
        setattr(layer, name, OneDNNLinear(lin.weight, _bias(lin)))
    return "onednn-packed"


def _bias(lin: nn.Linear) -> Tensor:
    return lin.bias if lin.bias is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype)


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
        """The attention kernel (A/Bs and tests): "fused" (where it can run), or per group "math" or "sdpa"."""
        if kind not in ("fused", "math", "sdpa"):
            raise ValueError(f"ModernBERT attends with fused, math or sdpa, not {kind!r}")
        if kind == "fused" and (why := fused_unavailable(self.packed)):
            raise ValueError(f"the fused kernel cannot attend here: {why}")
        self.packed.kernel = kind
        if kind != "fused":
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
        seen: dict[tuple[type, int, int], nn.Module] = {}  # a kernel per op and shape
        mods = [getattr(layer, name) for layer, name in _linears(self.packed)]
        for lin in [m for m in mods if isinstance(m, OneDNNLinear)] + list(self.packed.geglu or []):
            seen.setdefault((type(lin), int(lin.weight_in), int(lin.out_features)), lin)  # type: ignore[arg-type]
        dtype = self.packed.encoder.word.weight.dtype
        for n in token_buckets(max_batch_tokens):
            for (_, fan_in, _), lin in seen.items():
                lin(torch.zeros(n, fan_in, dtype=dtype))

    @property
    def torch(self) -> ModernPackedEngine:  # last in the class: the name would shadow the module above it
        return self


def fused_unavailable(module: PackedModernBert) -> str | None:
    """Why the fused kernel cannot attend for `module` (not built, a precision or head size it does not
    compute), or None where it can."""
    built, why = fused.available()
    if not built:
        return why
    dtype, hs = module.encoder.word.weight.dtype, module.encoder.blocks[0].head_size
    return None if fused.supports(dtype, hs) else f"it does not compute {dtype} at head size {hs}"


@torch.no_grad()
def rotary_probe(module: PackedModernBert) -> str | None:
    """Why the C rotary kernel must not serve `module` (missing, or turning rows otherwise than torch's ops on
    a random batch), or None where it matches them (float32: to 1e-6; bfloat16: to one rounding)."""
    if not fused.rotary_available():
        return "the library was built without it"
    layer, dtype = module.encoder.blocks[0], module.encoder.word.weight.dtype
    p = pack([[1] * n for n in (70, 33, 9)], [[0] * n for n in (70, 33, 9)], torch.device("cpu"), dtype)
    torch.manual_seed(0)
    qkv = torch.randn(len(p.ids), 3 * layer.heads * layer.head_size).to(dtype)
    want, got = qkv.clone(), qkv.clone()
    module.rope_kernel = False
    module.rotate(layer, want, p)
    module.rope_kernel = True
    module.rotate(layer, got, p)
    module.rope_kernel = False
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    return None if torch.allclose(got.float(), want.float(), atol=tol, rtol=tol) else "it disagrees with torch's ops"


def modern_engine(
    module: ModernBertForRelevance,
    device: torch.device,
    dtype: torch.dtype,
    pad_id: int,
    onednn: bool,
    attention: str = "auto",
) -> ModernPackedEngine:
    """The packed engine for a ModernBERT module (already cast to `dtype`), oneDNN linears with `onednn`; the
    fused attention kernel unless `attention` is "torch" or it cannot run here (then torch's, per group)."""
    packed = PackedModernBert(module)
    if attention == "torch":
        why: str | None = "asked for torch's kernels"
    else:
        why = fused_unavailable(packed)
    if why is None:
        packed.kernel = "fused"
        if packed.cfg.classifier_pooling == "cls":
            split_last_projection(packed)
        rope = rotary_probe(packed)
        packed.rope_kernel = rope is None
        turned = "in place (C)" if rope is None else f"by torch ({rope})"
        reason = f"fused: every pair's rows in place, rotary {turned}"
    else:
        reason = f"{attention}: per group of similar length ({why})"
    linears = install_linears(packed, dtype) if onednn else "plain"
    if packed.geglu is not None:
        reason += "; GeGLU in oneDNN's kernels"
    kernels = Kernels(linears, packed.kernel, None, reason)
    return ModernPackedEngine(packed, device, pad_id, kernels)
