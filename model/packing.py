"""Batches of variable-length pairs without padding, for inference.

`pack` lays out the real tokens of all pairs as one (N, H) matrix, longest pair first; embeddings,
projections, feed-forward and norms run on it directly, and attention gets per-group padded blocks of
pairs of similar length. The layers' `forward_packed` methods (model.bert) consume a `Packing`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


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
    server meets can be built once at warm-up (see `model.kernels.warm_linear_shapes`)."""
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


def length_batches(lengths: Sequence[int], max_batch_tokens: int, max_batch_size: int = 256) -> Iterable[list[int]]:
    """Indices grouped by length so that longest x count stays within the token budget."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    batch: list[int] = []
    for i in order:  # ascending: the newest item is the batch's longest
        if batch and (lengths[i] * (len(batch) + 1) > max_batch_tokens or len(batch) >= max_batch_size):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch
