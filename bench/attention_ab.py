"""A/B of the two attention kernels of qtrel's packed forward (issue 20): torch's
`F.scaled_dot_product_attention` once per length group and layer (on CPU in bfloat16, the flash kernel)
against `model.bert.math_attention` (two matmuls and a float32 softmax) for the same calls; the model's own
switch (`RelevanceModel.use_attention`) flips between them, and the report says which one this CPU ships
(`model.kernels.math_attention_pays`). Same batches of consecutive dev pairs as bench/forward_profile.py,
the two interleaved per round, median and range; plus the bare kernels on one group's shape.

  python bench/attention_ab.py --model model/default [--threads 1] [--pause-pid PID]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from anchors import isa, isa_line, slug_of
from model_speed import read_pairs
from results import command_line, machine, publish

from model.bert import math_attention
from model.relevance import RelevanceModel

SIZES = (8, 19, 32)


def run(m: RelevanceModel, batches, kernel: str) -> tuple[float, torch.Tensor]:
    m.use_attention(kernel)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = [m.logits(ids, seg) for ids, seg in batches]
        dt = time.perf_counter() - t0
    return 1e3 * dt / len(batches), torch.cat(out)


def bare(dtype: torch.dtype, b: int, t: int, reps: int = 200) -> dict:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, 12, t, 32, generator=g).to(dtype) for _ in range(3))
    out = {}
    with torch.inference_mode():
        for name, fn in (("flash SDPA", F.scaled_dot_product_attention), ("math", math_attention)):
            fn(q, k, v, None)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(q, k, v, None)
                ts.append(time.perf_counter() - t0)
            out[name] = 1e6 * statistics.median(ts)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("model/default"))
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pause-pid", type=int)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.batches, a.rounds = 2, 1
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.model, dtype="auto")
    m.warm_up()
    shipped = m.attention
    enc = m.encode(read_pairs(max(SIZES) * a.batches))
    data = {
        b: [(enc.input_ids[i : i + b], enc.token_type_ids[i : i + b]) for i in range(0, b * a.batches, b)]
        for b in SIZES
    }
    res: dict = {}
    if a.pause_pid:
        os.kill(a.pause_pid, signal.SIGSTOP)
    try:
        for b in SIZES:  # warm both once
            run(m, data[b], "sdpa")
            run(m, data[b], "math")
        ms: dict[str, list[float]] = {f"{b}/{w}": [] for b in SIZES for w in ("sdpa", "math")}
        diff = {}
        for r in range(a.rounds):
            for b in SIZES:
                for w in ("sdpa", "math") if r % 2 == 0 else ("math", "sdpa"):
                    t, out = run(m, data[b], w)
                    ms[f"{b}/{w}"].append(t)
                    diff.setdefault(b, {})[w] = out
        kernels = {
            f"b={b} t={t}": bare(m.module.bert.embeddings.word.weight.dtype, b, t)
            for b, t in ((2, 27), (6, 27), (6, 40))
        }
    finally:
        if a.pause_pid:
            os.kill(a.pause_pid, signal.SIGCONT)
    for b in SIZES:
        s, x = ms[f"{b}/sdpa"], ms[f"{b}/math"]
        per = [i / j for i, j in zip(s, x)]
        res[b] = {
            "ms_sdpa": statistics.median(s),
            "ms_math": statistics.median(x),
            "speedup_math": statistics.median(per),
            "speedup_range": [min(per), max(per)],
            "max_abs_logit_diff": (diff[b]["sdpa"] - diff[b]["math"]).abs().max().item(),
            "same_level": (diff[b]["sdpa"].argmax(-1) == diff[b]["math"].argmax(-1)).float().mean().item(),
            "all": {"sdpa": [round(v, 2) for v in s], "math": [round(v, 2) for v in x]},
        }
    report = {
        "isa_line": isa_line(isa()),
        "machine": machine(),
        "command": command_line(),
        "dtype": m.dtype,
        "shipped": shipped,
        "threads": a.threads,
        "rounds": a.rounds,
        "batches": a.batches,
        "forward": res,
        "bare_kernels_us": kernels,
    }
    lines = [
        f"### Attention kernel A/B inside the default forward (`bench/attention_ab.py`, {report['machine']['date']})",
        "",
        f"{m.dtype}, {a.threads} torch thread(s), {a.batches} batches of consecutive dev pairs per size, the two "
        f"interleaved over {a.rounds} rounds (median ms per forward; speed-up = median of the per-round ratios).",
        f"- command: `{report['command']}`",
        "",
        f"| batch | flash SDPA{' (shipped)' * (shipped == 'sdpa')} | math (2 matmuls + float32 softmax)"
        f"{' (shipped)' * (shipped == 'math')} | speed-up (range) | max abs logit diff | same level |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for b, r in res.items():
        lines.append(
            f"| {b} | {r['ms_sdpa']:.1f} | {r['ms_math']:.1f} | {r['speedup_math']:.2f} ({r['speedup_range'][0]:.2f}–"
            f"{r['speedup_range'][1]:.2f}) | {r['max_abs_logit_diff']:.1e} | {r['same_level']:.4f} |"
        )
    lines += ["", "Bare kernels on one group's shape (12 heads, head size 32), median µs per call:", ""]
    lines += [f"- {k}: " + ", ".join(f"{n} {v:.0f}" for n, v in d.items()) for k, d in kernels.items()]
    text = "\n".join(lines)
    print(text)
    publish("attention_ab", slug_of(isa()), report, text, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
