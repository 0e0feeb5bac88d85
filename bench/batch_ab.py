"""qtrel's forward against the anchors, interleaved batch by batch: for hosts whose speed swings within seconds.

`bench/anchors.py` interleaves whole passes. On a VM whose neighbours take the core's AMX or memory for a
second or two at a time (a Sapphire Rapids guest here swung a bare bf16 linear between 430 and 1,200 GFLOP/s
from one half-second to the next), one pass lands in a quiet spell and the next in a busy one, and the
ratios swing 0.6-2x. Here every system runs batch i before any runs batch i + 1 (in a random order per batch),
so a busy spell falls on all of them alike. Two estimates per system:

- **quiet**: per batch, the fastest of the repeats, summed: the machine as if no neighbour ran;
- **paired**: per repeat, each system's time over the anchor's on the same batches, then the median of
  those ratios.

  python bench/batch_ab.py --model model/default [--pairs 1000] [--repeats 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness.data import DEFAULT_MODEL, make_batches, read_pairs, tiny_checkpoint, useful_flops
from harness.machine import isa, isa_line, native_precision
from harness.publish import command_line, machine, publish
from harness.systems import export_onnx, hf_model, openvino_compiled

from model import fused_attention
from model.engines.packed import PackedLayer
from model.relevance import RelevanceModel

Step = Callable[[int], object]  # runs batch i


def openvino_step(onnx: Path, threads: int, precision: str, feeds: list[dict]) -> tuple[Step, str]:
    compiled, version = openvino_compiled(onnx, threads, precision, "LATENCY")
    req = compiled.create_infer_request()
    return (lambda i: req.infer(feeds[i])), version


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: model/default; --quick: a tiny random one)")
    p.add_argument("--pairs", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tag", default="", help="a label kept in the JSON (the table is this kind's at these threads)")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, 64 pairs, 1 repeat, scratch")
    a = p.parse_args()
    tmp_model = tempfile.TemporaryDirectory(prefix="qtrel-batch-ab-model-")
    if a.quick:
        a.pairs, a.repeats = min(a.pairs, 64), 1
        a.model = a.model or tiny_checkpoint(Path(tmp_model.name) / "tiny")
    a.model = a.model or DEFAULT_MODEL
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    cpu = isa()
    print("ISA: " + isa_line(cpu), flush=True)
    prec = native_precision(cpu)
    short = {"bfloat16": "bf16", "float32": "fp32"}[prec]

    def load() -> RelevanceModel:  # every system its own weights: none finds another's in cache
        x = RelevanceModel.load(a.model, dtype=prec)
        x.warm_up()
        return x

    m, flash = load(), load()
    flash.use_attention("sdpa")
    tok = m.tokenizer
    pairs = read_pairs(a.pairs)
    enc = tok.encode([q for q, _ in pairs], [t for _, t in pairs])
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    chunks = [order[i : i + 32] for i in range(0, len(order), 32)]
    lists = [([enc.input_ids[i] for i in c], [enc.token_type_ids[i] for i in c]) for c in chunks]
    batches = make_batches(tok, pairs)
    feeds = [b.feeds() for b in batches]
    hf = hf_model(a.model, "sdpa")
    if prec == "bfloat16":
        hf = hf.to(torch.bfloat16)

    def qtrel(model: RelevanceModel) -> Step:
        return lambda i: model.logits(*lists[i])

    def transformers(i: int) -> object:
        b = batches[i]
        return hf(input_ids=b.ids, attention_mask=b.mask, token_type_ids=b.seg).logits

    amx = m.attention == "fused" and fused_attention.amx()
    steps: dict[str, Step] = {
        f"qtrel default ({short}, {m.attention} attention{', AMX tiles' if amx else ''})": qtrel(m),
        f"qtrel, flash attention ({short})": qtrel(flash),
        f"transformers ({short}, sdpa)": transformers,
    }
    if amx:  # the same kernel on AVX512-BF16 dot products, as on a CPU without AMX
        no_amx = load()

        def without_amx(i: int) -> object:
            fused_attention.amx(False)
            try:
                return no_amx.logits(*lists[i])
            finally:
                fused_attention.amx(True)

        steps[f"qtrel, fused attention without AMX ({short})"] = without_amx
    if m.fused_norm:  # torch's residual adds and LayerNorms in the same forward: the fused norm's share here
        plain_norms = load()
        for x in plain_norms.module.modules():
            if isinstance(x, PackedLayer):
                x.fused_norm = False
        steps[f"qtrel default, torch's add + LayerNorm ({short})"] = qtrel(plain_norms)
    versions = {"torch": str(torch.__version__)}
    anchor = None
    with tempfile.TemporaryDirectory(prefix="qtrel-batch-ab-") as tmp:
        onnx = export_onnx(hf_model(a.model, "eager"), batches[len(batches) // 2], Path(tmp) / "m.onnx", dynamo=False)
        try:
            step, versions["openvino"] = openvino_step(onnx, a.threads, prec, feeds)
            anchor = f"OpenVINO ({short}, LATENCY hint)"
            steps[anchor] = step
        except ImportError:
            anchor = f"transformers ({short}, sdpa)"
        names = list(steps)
        times = {n: np.zeros((a.repeats, len(batches))) for n in names}
        with torch.inference_mode():
            for n in names:  # warm-up: every shape once
                for i in range(len(batches)):
                    steps[n](i)
            rng = np.random.default_rng(0)
            for r in range(a.repeats):
                t_rep = time.perf_counter()
                for i in range(len(batches)):
                    # in a fresh random order per batch, each system on a model of its own: with a rotation
                    # every system had the same predecessor, and a variant that ran after the default on the
                    # same model found its weights in cache (8% faster than the default, 6% slower in an A/B)
                    for n in (names[j] for j in rng.permutation(len(names))):
                        t0 = time.perf_counter()
                        steps[n](i)
                        times[n][r, i] = time.perf_counter() - t0
                print(f"  repeat {r + 1}/{a.repeats}: {time.perf_counter() - t_rep:.1f}s", flush=True)

    flops = useful_flops(m.cfg, enc.lengths)
    rows: list[dict[str, Any]] = []
    for n in names:
        quiet = times[n].min(axis=0).sum()
        totals = times[n].sum(axis=1)
        paired = [float(x) for x in times[anchor].sum(axis=1) / totals]  # > 1: faster than the anchor
        rows.append(
            {
                "system": n,
                "quiet_pairs_per_s": len(pairs) / quiet,
                "quiet_gflops": flops / quiet / 1e9,
                "median_pairs_per_s": len(pairs) / statistics.median(totals),
                "range_pairs_per_s": [len(pairs) / totals.max(), len(pairs) / totals.min()],
                "paired_x_anchor": statistics.median(paired),
                "paired_range": [min(paired), max(paired)],
            }
        )
    quiet_anchor = next(r["quiet_pairs_per_s"] for r in rows if r["system"] == anchor)
    for row in rows:
        row["quiet_x_anchor"] = row["quiet_pairs_per_s"] / quiet_anchor
    report = {
        "isa": cpu,
        "machine": machine(),
        "command": command_line(),
        "versions": versions,
        "pairs": len(pairs),
        "batches": len(batches),
        "threads": a.threads,
        "repeats": a.repeats,
        "anchor": anchor,
        "rows": rows,
    }
    md = render(report)
    print(md)
    publish(f"batch_ab-{a.threads}thread{'s' if a.threads > 1 else ''}", report | {"tag": a.tag}, md, a.quick)
    tmp_model.cleanup()
    return 0


def render(r: dict) -> str:
    lines = [
        f"### Batch-interleaved A/B, {r['threads']} thread(s): {r['machine']['cpu']} (`bench/batch_ab.py`, "
        f"{r['machine']['date']})",
        "",
        f"{r['pairs']} dev pairs, {r['batches']} batches of 32, {r['threads']} thread(s), {r['repeats']} repeats. "
        f"Anchor: {r['anchor']}.",
        "",
        f"- ISA: {isa_line(r['isa'])}",
        f"- command: `{r['command']}`",
        f"- versions: {', '.join(f'{k} {v}' for k, v in r['versions'].items())}",
        "",
        "| system | quiet pairs/s | quiet useful GFLOP/s | quiet × anchor | paired × anchor (range) "
        "| median pairs/s (range) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        lo, hi = x["paired_range"]
        a, b = x["range_pairs_per_s"]
        lines.append(
            f"| {x['system']} | {x['quiet_pairs_per_s']:,.0f} | {x['quiet_gflops']:.0f} | {x['quiet_x_anchor']:.2f} "
            f"| {x['paired_x_anchor']:.2f} ({lo:.2f}–{hi:.2f}) | {x['median_pairs_per_s']:,.0f} ({a:,.0f}–{b:,.0f}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
