"""A/B of the packed forward's residual add + LayerNorm (issue 20): torch's two ops (`norm(x + r)`) against the
fused kernel (`model.engines.fused.add_layer_norm`, one pass, in the same library as the fused attention),
on the bare op at a served batch's row counts and inside the whole default forward, interleaved per round on
the same batches of consecutive dev pairs as lab/attention_ab.py (median and range of the per-round ratios;
logits and levels against torch's ops).

  python lab/norm_ab.py --model model/default [--threads 1] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
from anchors import isa, isa_line, slug_of
from model_speed import consecutive_batches
from results import command_line, machine, publish
from torch import nn

from model.bert import Layer
from model.engines import fused
from model.relevance import RelevanceModel

SIZES = (8, 19, 32)
ROWS = (32, 216, 830)  # a batch of 1, 8 and 32 pairs of ~26 tokens


def bare(dtype: torch.dtype, rows: int, width: int, reps: int = 300) -> dict[str, float]:
    """Best µs of each, interleaved; the sublayer's output copied fresh each time, as the forward writes over it."""
    g = torch.Generator().manual_seed(0)
    norm = nn.LayerNorm(width, eps=1e-12).to(dtype)
    x, r = (torch.randn(rows, width, generator=g).to(dtype) for _ in range(2))
    best = {"torch": float("inf"), "fused": float("inf")}
    with torch.inference_mode():
        for _ in range(reps):
            for k in best:
                rr = r.clone()
                t0 = time.perf_counter()
                if k == "torch":
                    norm(x + rr)
                else:
                    fused.add_layer_norm(x, rr, norm, rr)
                best[k] = min(best[k], time.perf_counter() - t0)
    return {k: round(1e6 * v, 1) for k, v in best.items()}


def run(m: RelevanceModel, layers: list[Layer], batches, fused: bool) -> tuple[float, torch.Tensor]:
    for x in layers:
        x.fused_norm = fused
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = [m.logits(ids, seg) for ids, seg in batches]
        dt = time.perf_counter() - t0
    return 1e3 * dt / len(batches), torch.cat(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("model/default"))
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.batches, a.rounds = 2, 2
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.model, dtype="auto")
    if not m.fused_norm:
        print(f"the fused add + LayerNorm does not run here ({fused.available()[1] or m.dtype})")
        return 1
    m.warm_up()
    layers = [x for x in m.module.modules() if isinstance(x, Layer)]
    width = layers[0].attn_norm.normalized_shape[0]
    dtype = m.module.bert.embeddings.word.weight.dtype
    data = consecutive_batches(m, SIZES, a.batches)
    ms: dict[tuple[int, bool], list[float]] = {(b, f): [] for b in SIZES for f in (False, True)}
    out: dict[tuple[int, bool], torch.Tensor] = {}
    try:
        for b in SIZES:  # warm both
            for f in (False, True):
                run(m, layers, data[b], f)
        for r in range(a.rounds):
            for b in SIZES:
                for f in (r % 2 == 0, r % 2 == 1):  # each round starts with the other
                    t, out[b, f] = run(m, layers, data[b], f)
                    ms[b, f].append(t)
        ops = {n: bare(dtype, n, width) for n in ROWS}
    finally:
        for x in layers:
            x.fused_norm = True
    forward = {}
    for b in SIZES:
        per = [t / f for t, f in zip(ms[b, False], ms[b, True])]
        forward[b] = {
            "torch_ms": statistics.median(ms[b, False]),
            "fused_ms": statistics.median(ms[b, True]),
            "speedup": statistics.median(per),
            "speedup_range": [min(per), max(per)],
            "max_abs_logit_diff": (out[b, False] - out[b, True]).abs().max().item(),
            "same_level": (out[b, False].argmax(-1) == out[b, True].argmax(-1)).float().mean().item(),
        }
    report = {
        "isa_line": isa_line(isa()),
        "machine": machine(),
        "command": command_line(),
        "dtype": m.dtype,
        "threads": a.threads,
        "rounds": a.rounds,
        "batches": a.batches,
        "forward": forward,
        "bare_us": ops,
    }
    lines = [
        f"### Residual add + LayerNorm, fused against torch's ops (`lab/norm_ab.py`, {report['machine']['date']})",
        "",
        f"{m.dtype}, {a.threads} torch thread(s), attention {m.attention}; {a.batches} batches of consecutive dev "
        f"pairs per size, the two interleaved over {a.rounds} rounds (median ms per forward; speed-up = median of "
        "the per-round ratios; logits and levels against torch's ops).",
        f"- ISA: {report['isa_line']}",
        f"- command: `{report['command']}`",
        "",
        "| batch | torch's add + LayerNorm, ms | fused, ms | speed-up (range) | max abs logit diff | same level |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for b, r in forward.items():
        lines.append(
            f"| {b} | {r['torch_ms']:.2f} | {r['fused_ms']:.2f} | {r['speedup']:.3f} "
            f"({r['speedup_range'][0]:.3f}–{r['speedup_range'][1]:.3f}) | {r['max_abs_logit_diff']:.1e} | "
            f"{r['same_level']:.4f} |"
        )
    lines += ["", f"The bare op on (rows, {width}) {m.dtype} matrices, best µs of 300, from Python:", ""]
    lines += [
        f"- {n} rows: torch {d['torch']:.1f}, fused {d['fused']:.1f} ({d['torch'] / d['fused']:.2f}×)"
        for n, d in ops.items()
    ]
    text = "\n".join(lines)
    print(text)
    key = slug_of(isa()) + ("" if a.threads == 1 else f"-{a.threads}threads")
    publish("norm_ab", key, report, text, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
