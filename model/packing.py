"""Batches of variable-length pairs without padding, for inference.

`pack` lays out the real tokens of all pairs as one (N, H) matrix, longest pair first; embeddings,
projections, feed-forward and norms run on it directly, and attention gets per-group padded blocks of
pairs of similar length. The layers' `forward_packed` methods (model.bert) consume a `Packing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np
import torch
from torch import Tensor

from model.batches import length_batches  # noqa: F401  (re-exported: the batches qtrel score forms)


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
    pair first. Embeddings, projections, feed-forward and norms run on (N, H); attention either reads each
    pair's rows in place (`model.engines.fused`, from `starts` and `lengths`) or gets blocks per group of
    similar length (`groups`, built on first use; see `pack`)."""

    order: Tensor  # (B,) batch index of each packed pair
    ids: Tensor  # (N,)
    segments: Tensor  # (N,)
    positions: Tensor  # (N,)
    cls: Tensor  # (B,) packed row of each packed pair's first token
    starts: np.ndarray  # (B,) int64, the same rows as `cls`, for the fused kernel
    lengths: np.ndarray  # (B,) int64, each packed pair's token count
    spare: int = 0  # filler rows after the real tokens (see token_bucket)
    ratio: float = 0.8
    dtype: torch.dtype = torch.float32
    _groups: list[AttentionGroup] | None = field(default=None, repr=False)
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def groups(self) -> list[AttentionGroup]:
        if self._groups is None:
            self._groups = attention_groups(self.lengths, self.starts, self.ratio, self.ids.device, self.dtype)
        return self._groups

    def longer_than(self, tokens: int) -> int:
        """How many packed pairs have more than `tokens` tokens: the first ones, packed longest first."""
        return int(np.searchsorted(-self.lengths, -tokens, side="left"))

    def groups_of_first(self, n: int) -> list[AttentionGroup]:
        """`groups` of the first `n` packed pairs alone, which hold rows 0 .. starts[n] - 1."""
        if n == len(self.lengths):
            return self.groups
        device, dtype = self.ids.device, self.dtype
        return self.memo(
            f"groups of {n}", lambda: attention_groups(self.lengths[:n], self.starts[:n], self.ratio, device, dtype)
        )

    def memo(self, key: str, make: Callable[[], Any]) -> Any:
        """A value derived from this packing, made on first use: every layer of the forward reuses it."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


def pad_batch(
    input_ids: Sequence[Sequence[int]], token_type_ids: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Right-pad to the longest pair: (ids, segments, mask), each (B, T) int64. One flat copy of every
    token, scattered under the mask: a tensor per pair cost ~28 us a pair, which a GPU waited on."""
    lengths = np.fromiter(map(len, input_ids), dtype=np.int64, count=len(input_ids))
    if any(len(x) != len(s) for x, s in zip(input_ids, token_type_ids)) or len(input_ids) != len(token_type_ids):
        raise ValueError("every pair needs as many segment ids as token ids")
    keep = np.arange(lengths.max(initial=0)) < lengths[:, None]  # (B, T), row-major: each row's tokens in order
    n = int(lengths.sum())
    ids = np.full(keep.shape, pad_id, dtype=np.int64)
    ids[keep] = np.fromiter(chain.from_iterable(input_ids), dtype=np.int64, count=n)
    seg = np.zeros(keep.shape, dtype=np.int64)
    seg[keep] = np.fromiter(chain.from_iterable(token_type_ids), dtype=np.int64, count=n)
    return torch.from_numpy(ids), torch.from_numpy(seg), torch.from_numpy(keep.astype(np.int64))


def token_bucket(n: int) -> int:
    """`n` rounded up to a short ladder of sizes (at most 1/8 more, 79 sizes up to 8192 tokens).
    oneDNN builds a kernel per new input shape of a linear layer: ~9 ms each in bfloat16 on this CPU,
    more than a whole small batch takes. With the packed token count on this ladder, every shape a
    server meets can be built once at warm-up (see `model.engines.kernels.warm_linear_shapes`). The fine steps at
    the bottom are for small batches: a one-pair forward's ~27 tokens and the last layer's [CLS] rows
    (one a pair) cost 3-5% less on steps of 8 and 1, 2, 4, 8 than on steps of 16 (lab/bucket_ab.py)."""
    if n <= 8:
        return 1 << (n - 1).bit_length() if n > 0 else 0
    granule = 8 if n <= 64 else 16 if n <= 256 else 32 if n <= 1024 else 128 if n <= 4096 else 512
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
    input_ids: Sequence[Sequence[int]],
    token_type_ids: Sequence[Sequence[int]],
    device: torch.device,
    dtype: torch.dtype,
    ratio: float = 0.8,
) -> Packing:
    """Pack a batch; consecutive pairs (by length, longest first) share an attention block while their
    length is at least `ratio` of the block's longest, so a block is at most ~1/ratio padded.
    Padding costs twice on CPU: in the service's batches of concurrent one-pair requests, 30-40% of the
    padded tokens were padding, and attention took a third of the forward (docs/design.md)."""
    lengths = np.fromiter(map(len, input_ids), dtype=np.int64, count=len(input_ids))
    if not len(lengths) or lengths.min() == 0:
        raise ValueError("every pair needs at least one token")
    # numpy throughout, one tensor per field: per-pair tensors cost ~1 ms a served batch of 32 (Zen 3)
    order = np.argsort(-lengths, kind="stable")  # longest first, ties in batch order
    lens = lengths[order]
    starts = np.cumsum(lens) - lens
    acc = int(lens.sum())
    spare = token_bucket(acc) - acc  # filler rows: computed by the linear layers, never attended to or read
    ids, seg, positions = (np.zeros(acc + spare, dtype=np.int64) for _ in range(3))
    ids[:acc] = np.fromiter(chain.from_iterable(input_ids[i] for i in order), dtype=np.int64, count=acc)
    seg[:acc] = np.fromiter(chain.from_iterable(token_type_ids[i] for i in order), dtype=np.int64, count=acc)
    positions[:acc] = np.arange(acc) - np.repeat(starts, lens)
    return Packing(
        order=torch.from_numpy(order).to(device),
        ids=torch.from_numpy(ids).to(device),
        segments=torch.from_numpy(seg).to(device),
        positions=torch.from_numpy(positions).to(device),
        cls=torch.from_numpy(starts).to(device),
        starts=starts,
        lengths=lens,
        spare=spare,
        ratio=ratio,
        dtype=dtype,
    )


def attention_groups(
    lens: np.ndarray, starts: np.ndarray, ratio: float, device: torch.device, dtype: torch.dtype
) -> list[AttentionGroup]:
    """Consecutive packed pairs (longest first) grouped while each is at least `ratio` of its group's longest,
    each group one padded (b, t) block for torch's attention kernels."""
    groups = []
    i = 0
    while i < len(lens):
        t = int(lens[i])
        j = i + int(np.searchsorted(-lens[i:], -ratio * t, side="right"))  # lens[i:j] >= ratio * t
        gl, gs = lens[i:j], starts[i:j]
        slots = np.arange(t)[None, :]  # (1, t)
        keep = slots < gl[:, None]  # (b, t)
        gather = torch.from_numpy(np.minimum(gs[:, None] + slots, (gs + gl - 1)[:, None]).reshape(-1))
        if bool(keep.all()):
            real, bias = None, None
        else:
            real = torch.from_numpy(np.flatnonzero(keep)).to(device)
            pad = torch.from_numpy(~keep)[:, None, None, :]
            bias = torch.zeros(j - i, 1, 1, t, dtype=dtype).masked_fill(pad, torch.finfo(dtype).min).to(device)
        groups.append(AttentionGroup(gather.to(device), real, bias, j - i, t))
        i = j
    return groups


def token_slices(lengths: Sequence[int], max_tokens: int) -> list[slice]:
    """Consecutive slices of a batch holding at most `max_tokens` tokens each (a longer pair alone)."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths):
        if acc and acc + n > max_tokens:
            out.append(slice(start, i))
            start, acc = i, 0
        acc += n
    out.append(slice(start, len(lengths)))
    return out
