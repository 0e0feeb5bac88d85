"""What each oneDNN ISA cap leaves a user: the bfloat16 probe, the float32 and bfloat16 speed of a bare FFN
linear, and what `dtype=auto` picks, each cap in a fresh process (oneDNN reads `ONEDNN_MAX_CPU_ISA` once,
when it starts). Prints a markdown table; the figures are one process each, not interleaved.

  python lab/isa_caps.py [--caps AVX2 AVX512_CORE_VNNI ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, statistics, time, torch
import torch.nn.functional as F
from model.device import bf16_capped, resolve_dtype
from model.engines.onednn import probe
torch.set_num_threads(1)
out = {"capability": torch.backends.cpu.get_cpu_capability(), "probe_bf16": probe(torch.bfloat16),
       "auto": resolve_dtype("auto", "cpu"), "capped": bf16_capped()}
for dt in (torch.float32, torch.bfloat16):
    x, w = torch.randn(256, 384).to(dt), torch.randn(1536, 384).to(dt)
    F.linear(x, w)
    ts = []
    for _ in range(7):
        t = time.perf_counter(); F.linear(x, w); ts.append(time.perf_counter() - t)
    out[str(dt).removeprefix("torch.")] = 2 * 256 * 384 * 1536 / statistics.median(ts) / 1e9
# torch._int_mm (s8 x s8 -> s32): exact with VNNI; without it oneDNN's u8 x s8 pairs saturate int16
x = torch.randint(-127, 128, (64, 384), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
for bits in (8, 7):
    q = 2 ** (bits - 1) - 1
    w = torch.randint(-q, q + 1, (384, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    got, exact = torch._int_mm(x, w).long(), x.long() @ w.long()
    out[f"int_mm_w{bits}_wrong"] = (got != exact).float().mean().item()
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--caps", nargs="+", default=["", "AVX512_CORE_BF16", "AVX512_CORE_VNNI", "AVX2"])
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    print(
        "| cap | get_cpu_capability() | oneDNN bf16 probe | float32 GFLOP/s | bfloat16 GFLOP/s | dtype=auto "
        "| `_int_mm` outputs wrong, 8-bit / 7-bit weights |"
    )
    print("|---|---|---|---:|---:|---|---|")
    for cap in args.caps:
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
        if cap:
            env["ONEDNN_MAX_CPU_ISA"] = cap
        env["PYTHONPATH"] = str(ROOT)
        run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        r = json.loads(run.stdout.strip().splitlines()[-1])
        verdict = "passes" if r["probe_bf16"] is None else r["probe_bf16"][:60]
        print(
            f"| {cap or 'none'} | {r['capability']} | {verdict} | {r['float32']:.0f} | {r['bfloat16']:.1f} | "
            f"{r['auto']} | {r['int_mm_w8_wrong']:.1%} / {r['int_mm_w7_wrong']:.1%} |"
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
