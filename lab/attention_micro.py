"""The attention kernel alone, on the packed forward's block shapes (issue 20): where its time goes and
which variants of `model.engines.packed.math_attention` were tried.

One block is b pairs × t tokens × 12 heads of 32 (MiniLM), in bfloat16, 1 thread; with `pad`, a fifth of
the keys are masked as `model.packing` masks them. Variants, each timed interleaved (median of rounds):
  math      the shipped kernel: bf16 q·kᵀ, scores cast to float32, scale (+ mask), softmax, cast, bf16 p·v
  bf16-sm   the same with the softmax in bfloat16 (torch computes it in float32 inside, no casts outside)
  q-scaled  the scale folded into q, then as bf16-sm
  sdpa      torch's scaled_dot_product_attention (the flash kernel on CPU)
  contig    the shipped kernel on contiguous copies of q, k and v (the copies timed)
  jagged    torch's SDPA on jagged nested tensors of the block's pairs (no mask needed; building them
            not timed, so a bound in its favour)
  flex      (with --flex) flex_attention compiled by inductor (a C++ kernel, built at first call) on the
            block as packed rows, (1, heads, b·t, 32), with a block mask that keeps each pair to itself:
            the fused kernel over packed rows that the forward would want
torch's `varlen_attn` (packed rows, no padding) is tried once; on torch 2.13 it has no CPU kernel.
`err` is the largest difference from the float32 reference. Then the shipped kernel's steps, timed apart.

  python lab/attention_micro.py [--rounds 7] [--calls 200] [--flex]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from model.engines.packed import math_attention

SHAPES = ((6, 27, False), (6, 40, True), (12, 20, False), (3, 60, True))  # b, t, padded


def bf16_softmax(q, k, v, bias):
    s = torch.matmul(q, k.transpose(-1, -2))
    s = s.mul_(q.shape[-1] ** -0.5) if bias is None else torch.add(bias, s, alpha=q.shape[-1] ** -0.5)
    return torch.matmul(s.softmax(-1), v)


def q_scaled(q, k, v, bias):
    s = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    return torch.matmul((s if bias is None else s.add_(bias)).softmax(-1), v)


def sdpa(q, k, v, bias):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def contiguous(q, k, v, bias):
    return math_attention(q.contiguous(), k.contiguous(), v.contiguous(), bias)


def jagged(q, k, v, bias):
    keep = None if bias is None else bias[:, 0, 0] == 0  # (b, t): the keys a pair really has

    def nest(x):  # (b, heads, t, d) -> jagged (b, heads, t_i, d), each pair at its own length
        rows = [x[i].transpose(0, 1) if keep is None else x[i].transpose(0, 1)[keep[i]] for i in range(len(x))]
        return torch.nested.nested_tensor(rows, layout=torch.jagged).transpose(1, 2)

    nq, nk, nv = nest(q), nest(k), nest(v)
    return lambda: F.scaled_dot_product_attention(nq, nk, nv)


VARIANTS = {
    "math": math_attention,
    "bf16-sm": bf16_softmax,
    "q-scaled": q_scaled,
    "sdpa": sdpa,
    "contig": contiguous,
}


def flex(q, k, v, bias, compiled):
    """flex_attention over the block as packed rows; unpadded blocks only (a padded pair's keys would need
    its real length in the mask, which this micro benchmark does not model)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, h, t, d = q.shape
    pair = torch.arange(b).repeat_interleave(t)
    mask = create_block_mask(lambda _b, _h, i, j: pair[i] == pair[j], None, None, b * t, b * t, device="cpu")
    qp, kp, vp = (x.transpose(1, 2).reshape(1, b * t, h, d).transpose(1, 2).contiguous() for x in (q, k, v))

    def run():
        return compiled(qp, kp, vp, block_mask=mask).view(h, b, t, d).transpose(0, 1)

    return run


def varlen_on_cpu() -> str:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return f"not in this torch ({e})"
    x = torch.randn(54, 12, 32).bfloat16()
    cu = torch.tensor([0, 27, 54], dtype=torch.int32)
    try:
        varlen_attn(x, x, x, cu, cu, 27, 27)
    except (NotImplementedError, RuntimeError) as e:
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return "runs"


def block(b: int, t: int, pad: bool):
    qkv = torch.randn(b * t, 3 * 384).bfloat16()
    q, k, v = qkv.view(b, t, 3, 12, 32).permute(2, 0, 3, 1, 4)  # as forward_packed slices them
    if not pad:
        return q, k, v, None
    keep = torch.rand(b, t) > 0.2
    keep[:, 0] = True
    low = torch.finfo(torch.bfloat16).min
    return q, k, v, torch.zeros(b, 1, 1, t, dtype=torch.bfloat16).masked_fill(~keep[:, None, None, :], low)


def err(run, ref: torch.Tensor, bias) -> str:
    """Largest difference from the float32 reference."""
    out = run[0](*run[1])
    if out.is_nested:  # rows at their own lengths: comparable where no key was masked
        out = torch.stack(out.transpose(1, 2).unbind()).transpose(1, 2) if bias is None else None
    return "n/a" if out is None else f"{(out.float() - ref).abs().max():.3f}"


def micros(f, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--flex", action="store_true", help="also flex_attention (compiles a kernel per shape)")
    a = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*nested tensors.*")
    print(f"torch {torch.__version__}: varlen_attn on CPU {varlen_on_cpu()}")
    compiled = None
    if a.flex:
        from torch.nn.attention.flex_attention import flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
    for b, t, pad in SHAPES:
        q, k, v, bias = block(b, t, pad)
        ref = math_attention(q.float(), k.float(), v.float(), None if bias is None else bias.float())
        runs = {n: (f, (q, k, v, bias)) for n, f in VARIANTS.items()}
        runs["jagged"] = (lambda f: f(), (jagged(q, k, v, bias),))
        if compiled is not None and bias is None:
            runs["flex"] = (lambda f: f(), (flex(q, k, v, bias, compiled),))
        for f, x in runs.values():  # warm: flex compiles its kernel here
            f(*x)
        times: dict[str, list[float]] = {n: [] for n in runs}
        for _ in range(a.rounds):
            for n, (f, x) in runs.items():
                times[n].append(micros(lambda f=f, x=x: f(*x), a.calls))
        row = ", ".join(f"{n} {statistics.median(x):.0f} µs (err {err(runs[n], ref, bias)})" for n, x in times.items())
        print(f"b={b} t={t}{' padded' if pad else ''}: {row}")
    q, k, v, _ = block(6, 27, False)
    s = torch.matmul(q, k.transpose(-1, -2))
    s32 = s.float()
    p32 = s32.softmax(-1)
    p16 = p32.bfloat16()
    s32_wide = torch.randn(6, 12, 27, 32)  # the same rows, 32 wide: whole AVX-512 vectors
    steps = {
        "q·kᵀ": lambda: torch.matmul(q, k.transpose(-1, -2)),
        "cast to float32": lambda: s.float(),
        "scale": lambda: s32.mul(0.1768),
        "softmax float32": lambda: s32.softmax(-1),
        "the same on rows of 32": lambda: s32_wide.softmax(-1),
        "cast to bf16": lambda: p32.bfloat16(),
        "p·v": lambda: torch.matmul(p16, v),
    }
    med = {n: statistics.median(micros(f, a.calls) for _ in range(a.rounds)) for n, f in steps.items()}
    print("the shipped kernel's steps, b=6 t=27: " + ", ".join(f"{n} {x:.0f} µs" for n, x in med.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
