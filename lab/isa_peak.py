"""The one-core arithmetic ceiling of this CPU, per precision, beside oneDNN's linear at MiniLM's shapes (issue 20).

The offline target is a ratio against the best anchor; a ratio the core cannot reach is no target. This probe
measures what one core issues: a loop of 12 independent multiply-add chains of one instruction (AVX2 and
AVX-512 float32 FMA, AVX512-BF16 `vdpbf16ps`, AVX512-VNNI `vpdpbusd`), compiled here with gcc, each only
where the CPU has it. Beside it, the pre-packed oneDNN linear qtrel runs (model.engines.onednn) on the encoder's four
shapes at 1 thread. The ceiling
on qtrel's offline ratio is then: peak ÷ the anchor's useful GFLOP/s (bench/batch_ab.py), since qtrel's
forward already does the fewest multiply-adds the model allows (the [CLS]-only last layer, no padding).
AMX is not probed (its tiles need the kernel's permission and a tile configuration).

  python lab/isa_peak.py [--seconds 0.3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from anchors import isa, isa_line, slug_of
from results import command_line, machine, publish
from torch import nn

from model.device import cpu_flags
from model.engines.onednn import OneDNNLinear, onednn_available

SOURCE = r"""
#include <immintrin.h>
#define CHAINS 12
#define LOOP(T, ZERO, OP, SUM) \
    T acc[CHAINS]; for (int i = 0; i < CHAINS; i++) acc[i] = ZERO; \
    for (long it = 0; it < iters; it++) { _Pragma("GCC unroll 12") for (int i = 0; i < CHAINS; i++) acc[i] = OP; } \
    float s = 0; for (int i = 0; i < CHAINS; i++) s += SUM; return s;

__attribute__((target("avx2,fma"))) float fma256(long iters) {
    __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
    LOOP(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(a, b, acc[i]), _mm256_cvtss_f32(acc[i]))
}
__attribute__((target("avx512f"))) float fma512(long iters) {
    __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
    LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(a, b, acc[i]), _mm512_reduce_add_ps(acc[i]))
}
__attribute__((target("avx512f,avx512bf16"))) float bf16dot512(long iters) {
    __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1.0f), _mm512_set1_ps(0.5f)), b = a;
    LOOP(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(acc[i], a, b), _mm512_reduce_add_ps(acc[i]))
}
__attribute__((target("avx512f,avx512vnni"))) float vnni512(long iters) {
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    LOOP(__m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(acc[i], a, b),
         (float)_mm512_reduce_add_epi32(acc[i]))
}
"""

# name: (CPU flags it needs, multiply-add operations per instruction x 2, what it is)
KERNELS = {
    "fma256": ({"avx2", "fma"}, 16, "float32, AVX2 FMA (8 lanes)"),
    "fma512": ({"avx512f"}, 32, "float32, AVX-512 FMA (16 lanes)"),
    "bf16dot512": ({"avx512f", "avx512_bf16"}, 64, "bfloat16, AVX512-BF16 vdpbf16ps (16 lanes x 2 pairs)"),
    "vnni512": ({"avx512f", "avx512_vnni"}, 128, "int8, AVX512-VNNI vpdpbusd (16 lanes x 4 pairs)"),
}
CHAINS = 12
SHAPES = {
    "q/k/v fused (384→1152)": (384, 1152),
    "attention out (384→384)": (384, 384),
    "FFN up (384→1536)": (384, 1536),
    "FFN down (1536→384)": (1536, 384),
}


def build(tmp: Path) -> ctypes.CDLL:
    src, lib = tmp / "peak.c", tmp / "peak.so"
    src.write_text(SOURCE)
    subprocess.run(["gcc", "-O3", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    for name in KERNELS:
        getattr(dll, name).restype, getattr(dll, name).argtypes = ctypes.c_float, [ctypes.c_long]
    return dll


def gops(fn, ops_per_iter: float, seconds: float, repeats: int, threads: int = 1) -> list[float]:
    """G operations per second of `fn(iters)`; with `threads`, that many calls at once (ctypes lets go of the
    GIL), summed: all cores busy run at a lower clock than one."""
    iters = 1000
    while True:  # size the loop to ~seconds
        t0 = time.perf_counter()
        fn(iters)
        dt = time.perf_counter() - t0
        if dt > 0.02:
            break
        iters *= 4
    iters = max(1, int(iters * seconds / dt))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if threads == 1:  # on this thread: a new one would not have torch's thread count (its OpenMP team is its own)
            fn(iters)
        else:
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                list(pool.map(fn, [iters] * threads))
        out.append(threads * ops_per_iter * iters / (time.perf_counter() - t0) / 1e9)
    return out


def linear_gflops(dtype: torch.dtype, k: int, n: int, rows: int, seconds: float, repeats: int) -> list[float]:
    """The linear layer qtrel's forward runs: oneDNN with the weight pre-packed where this torch has it."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    lin = OneDNNLinear(w, b) if onednn_available(dtype) else nn.Linear(k, n).to(dtype)
    with torch.inference_mode():
        calls = lambda it: [lin(x) for _ in range(it)]  # noqa: E731
        return gops(calls, 2 * rows * k * n, seconds, repeats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=0.3, help="per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", type=int, default=832, help="tokens in the linear's input (32 pairs of ~26)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.seconds, a.repeats = 0.05, 2
    torch.set_num_threads(1)
    flags, cores = cpu_flags(), len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        kernels = {name: per for name, (need, per, _) in KERNELS.items() if need <= flags}
        peaks = {name: gops(getattr(dll, name), per * CHAINS, a.seconds, a.repeats) for name, per in kernels.items()}
        all_cores = {
            name: gops(getattr(dll, name), per * CHAINS, a.seconds, a.repeats, cores) for name, per in kernels.items()
        }
    dtypes = {"float32": torch.float32} | ({"bfloat16": torch.bfloat16} if "avx512_bf16" in flags else {})
    linears = {
        dt: {s: linear_gflops(t, k, n, a.rows, a.seconds, a.repeats) for s, (k, n) in SHAPES.items()}
        for dt, t in dtypes.items()
    }
    report = {
        "isa_line": isa_line(isa()),
        "machine": machine(),
        "command": command_line(),
        "rows": a.rows,
        "peaks": peaks,
        "cores": cores,
        "all_cores": all_cores,
        "linears": linears,
    }
    lines = [
        f"### One core's arithmetic ceiling (`lab/isa_peak.py`, {report['machine']['date']})",
        "",
        f"- ISA: {report['isa_line']}",
        f"- command: `{report['command']}`",
        f"- 1 thread; median (range) of {a.repeats} runs of ~{a.seconds} s; {CHAINS} independent chains per loop",
        "",
        f"| instruction loop | peak, G multiply-add ops × 2 per s, 1 core | all {cores} cores at once | per core |",
        "|---|---:|---:|---:|",
    ]
    for name, g in peaks.items():
        g2 = all_cores[name]
        lines.append(
            f"| {KERNELS[name][2]} | {statistics.median(g):.0f} ({min(g):.0f}–{max(g):.0f}) | "
            f"{statistics.median(g2):.0f} ({min(g2):.0f}–{max(g2):.0f}) | {statistics.median(g2) / cores:.0f} |"
        )
    lines += ["", f"The pre-packed oneDNN linear on {a.rows} rows, GFLOP/s (share of the same precision's peak):", ""]
    lines += ["| linear | " + " | ".join(linears) + " |", "|---|" + "---:|" * len(linears)]
    peak_of = {"float32": "fma512" if "fma512" in peaks else "fma256", "bfloat16": "bf16dot512"}
    for s in SHAPES:
        cells = []
        for dt, rows in linears.items():
            got, pk = statistics.median(rows[s]), statistics.median(peaks[peak_of[dt]])
            cells.append(f"{got:.0f} ({got / pk:.0%})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if "amx_bf16" in flags:
        lines += ["", "This CPU has AMX, which the loops above do not use: oneDNN's bf16 linear can exceed their peak."]
    text = "\n".join(lines)
    print(text)
    publish("isa_peak", slug_of(isa()), report, text, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
