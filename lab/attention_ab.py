"""A/B of the attention kernels of qtrel's packed forward (issue 20): torch's
`F.scaled_dot_product_attention` once per length group and layer (on CPU, the flash kernel), against
`model.engines.packed.math_attention` (two matmuls and a float32 softmax) for the same calls, and against the fused
kernel (`model.engines.fused`: one call a layer over every pair's rows in place) where it is built; the
model's own switch (`RelevanceModel.use_attention`) flips between them, and the report says which one this
CPU ships (`model.engines.kernels.choose_attention`, with its start-up probe's figures). Same batches of
consecutive dev pairs as lab/forward_profile.py, the kernels interleaved per round, median and range;
plus the bare kernels on one group's shape.

  python lab/attention_ab.py --model model/default [--threads 1] [--pause-pid PID]
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
from model_speed import consecutive_batches
from results import command_line, machine, publish

from model.engines import fused
from model.engines.packed import math_attention
from model.relevance import RelevanceModel

SIZES = (8, 19, 32)


def run(m: RelevanceModel, batches, kernel: str) -> tuple[float, torch.Tensor]:
    # "fused-dot": the fused kernel on AVX512-BF16 dot products where its AMX path would run; "fused-f32": in
    # float32 arithmetic where either would
    fused.bf16_dot(kernel != "fused-f32")
    fused.amx(kernel == "fused")
    m.use_attention("fused" if kernel.startswith("fused") else kernel)
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
    data = consecutive_batches(m, SIZES, a.batches)
    res: dict = {}
    kinds = ("sdpa", "math") + (("fused",) if fused.available()[0] else ())
    amx = m.dtype == "bfloat16" and fused.amx()
    if amx:
        kinds += ("fused-dot",)
    if m.dtype == "bfloat16" and fused.bf16_dot():
        kinds += ("fused-f32",)
    if a.pause_pid:
        os.kill(a.pause_pid, signal.SIGSTOP)
    try:
        for b in SIZES:  # warm each once
            for w in kinds:
                run(m, data[b], w)
        ms: dict[str, list[float]] = {f"{b}/{w}": [] for b in SIZES for w in kinds}
        diff: dict[int, dict[str, torch.Tensor]] = {}
        for r in range(a.rounds):
            for b in SIZES:
                for w in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # each round starts with another
                    t, out = run(m, data[b], w)
                    ms[f"{b}/{w}"].append(t)
                    diff.setdefault(b, {})[w] = out
        kernels = {
            f"b={b} t={t}": bare(m.module.bert.embeddings.word.weight.dtype, b, t)
            for b, t in ((2, 27), (6, 27), (6, 40))
        }
    finally:
        fused.bf16_dot(True)
        fused.amx(True)
        if a.pause_pid:
            os.kill(a.pause_pid, signal.SIGCONT)
    for b in SIZES:
        s = ms[f"{b}/sdpa"]
        res[b] = {"ms": {w: statistics.median(ms[f"{b}/{w}"]) for w in kinds}, "all": {}}
        for w in kinds:
            res[b]["all"][w] = [round(v, 2) for v in ms[f"{b}/{w}"]]
            if w == "sdpa":
                continue
            per = [i / j for i, j in zip(s, ms[f"{b}/{w}"])]
            res[b][w] = {
                "speedup": statistics.median(per),
                "speedup_range": [min(per), max(per)],
                "max_abs_logit_diff": (diff[b]["sdpa"] - diff[b][w]).abs().max().item(),
                "same_level": (diff[b]["sdpa"].argmax(-1) == diff[b][w].argmax(-1)).float().mean().item(),
            }
    report = {
        "isa_line": isa_line(isa()),
        "machine": machine(),
        "command": command_line(),
        "dtype": m.dtype,
        "shipped": shipped,
        "probe": m.attention_probe,
        "threads": a.threads,
        "rounds": a.rounds,
        "batches": a.batches,
        "forward": res,
        "bare_kernels_us": kernels,
    }
    names = {
        "sdpa": "flash SDPA",
        "math": "math (2 matmuls + float32 softmax)",
        "fused": "fused (one call a layer)"
        + (", AMX tiles" if amx else ", AVX512-BF16 dot products" if "fused-f32" in kinds else ""),
        "fused-dot": "fused, AVX512-BF16 dot products",
        "fused-f32": "fused, float32 arithmetic",
    }
    others = [w for w in kinds if w != "sdpa"]
    lines = [
        f"### Attention kernel A/B inside the default forward (`lab/attention_ab.py`, {report['machine']['date']})",
        "",
        f"{m.dtype}, {a.threads} torch thread(s), {a.batches} batches of consecutive dev pairs per size, the "
        f"kernels interleaved over {a.rounds} rounds (median ms per forward; speed-up over flash = median of the "
        f"per-round ratios; logits and levels against flash's). Shipped here: **{shipped}**"
        + (f" (start-up probe, ms per layer: {m.attention_probe})." if m.attention_probe else "."),
        f"- command: `{report['command']}`",
        "",
        "| batch | "
        + " | ".join(names[w] + " ms" for w in kinds)
        + " | "
        + " | ".join(f"{w}: speed-up (range), max abs logit diff, same level" for w in others)
        + " |",
        "|---:" * (1 + len(kinds) + len(others)) + "|",
    ]
    for b, r in res.items():
        cells = [f"{r['ms'][w]:.1f}" for w in kinds] + [
            f"{r[w]['speedup']:.2f} ({r[w]['speedup_range'][0]:.2f}–{r[w]['speedup_range'][1]:.2f}), "
            f"{r[w]['max_abs_logit_diff']:.1e}, {r[w]['same_level']:.4f}"
            for w in others
        ]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += ["", "Bare kernels on one group's shape (12 heads, head size 32), median µs per call:", ""]
    lines += [f"- {k}: " + ", ".join(f"{n} {v:.0f}" for n, v in d.items()) for k, d in kernels.items()]
    text = "\n".join(lines)
    print(text)
    key = slug_of(isa()) + ("" if a.threads == 1 else f"-{a.threads}threads")  # a section per thread count
    publish("attention_ab", key, report, text, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
