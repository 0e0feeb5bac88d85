"""Where qtrel's default forward spends its time (issue 20): torch.profiler on the default path (the
machine's native precision, unpadded, oneDNN linears) at batches of 8, 19 and 32 real dev pairs.

Batches are consecutive dev pairs in file order (a server's mix of lengths, not length-sorted). Each op's
self time goes to one share: the matmuls (oneDNN linears, addmm), the attention kernel (torch's SDPA
kernel, or the two matmuls and float32 softmax of `model.engines.packed.math_attention` where that is the CPU's
choice), the gathers and layout work around it, LayerNorm, residual adds, GELU, embeddings, building
the packing, and Python (the self time of our own record_function scopes: the forward, each layer's
attention loop, `pack`).
The wall time of the same forwards without the profiler is beside it, at 2 threads and at 1 thread
(the thread layout: two 1-thread processes against one 2-thread one).

  python lab/forward_profile.py --model model/default [--pause-pid PID] [--pause-match 'qtrel train']
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch
from anchors import Pause, isa, isa_line, slug_of
from model_speed import consecutive_batches
from results import DOCS, command_line, machine, publish, update_section
from torch.profiler import ProfilerActivity, profile, record_function

import model.engines.packed as packed
from model.engines import fused
from model.relevance import RelevanceModel

SIZES = (8, 19, 32)
MATMUL = {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm", "aten::linear", "aten::matmul"}
LAYOUT = {
    "aten::index_select",
    "aten::cat",
    "aten::copy_",
    "aten::permute",
    "aten::transpose",
    "aten::reshape",
    "aten::view",
    "aten::contiguous",
    "aten::clone",
    "aten::new_zeros",
    "aten::zeros",
    "aten::zero_",
    "aten::fill_",
    "aten::empty",
    "aten::empty_like",
    "aten::index_copy_",
    "aten::split",
    "aten::split_with_sizes",
    "aten::narrow",
    "aten::slice",
    "aten::unbind",
    "aten::select",
    "aten::as_strided",
    "aten::_unsafe_view",
    "aten::expand",
    "aten::resize_",
}


ATTENTION_KERNEL = "attention kernel (SDPA, math or fused)"


def share_of(e, scopes: list[str]) -> str:
    if "qtrel::math_attention" in scopes or "scaled_dot_product" in e.name or e.name == "qtrel::fused_attention":
        return ATTENTION_KERNEL  # the fused kernel is one ctypes call: its scope's self time is the C code
    if e.name == "qtrel::add_layer_norm":  # the fused residual add + LayerNorm: one ctypes call too
        return "residual add + LayerNorm, fused"
    if "qtrel::pack" in scopes:
        return "packing (model.packing.pack)"
    if e.name.startswith("qtrel::"):
        return "Python: attention loop per group" if e.name == "qtrel::attention" else "Python: rest of the forward"
    if e.name in MATMUL:
        return "matmuls (linears)"
    if e.name in LAYOUT:
        return "attention gathers/layout" if "qtrel::attention" in scopes else "other layout/copies"
    if "layer_norm" in e.name:
        return "LayerNorm"
    if e.name in ("aten::add", "aten::add_"):
        return "residual adds" if "qtrel::embeddings" not in scopes else "embeddings"
    if "gelu" in e.name:
        return "GELU"
    if e.name == "aten::embedding" or "qtrel::embeddings" in scopes:
        return "embeddings"
    return "other ops"


def scoped(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        with record_function(name):
            return fn(*a, **k)

    return wrapper


def instrument() -> None:
    """Named scopes on the model's Python without touching model/: the packing, each layer's attention
    (its loop over length groups), the embeddings, the whole forward."""
    packed.pack = scoped("qtrel::pack", packed.pack)
    packed.math_attention = scoped("qtrel::math_attention", packed.math_attention)  # _attend looks it up per call
    packed.packed_attention = scoped("qtrel::fused_attention", packed.packed_attention)  # likewise
    fused.add_layer_norm = scoped("qtrel::add_layer_norm", fused.add_layer_norm)  # add_norm's
    packed.PackedSelfAttention.forward_packed = scoped("qtrel::attention", packed.PackedSelfAttention.forward_packed)
    packed.embed = scoped("qtrel::embeddings", packed.embed)
    model_class = packed.PackedBertForRelevance
    model_class.forward_packed = scoped("qtrel::forward", model_class.forward_packed)


def profile_size(m: RelevanceModel, batches: list[tuple[list, list]]) -> dict:
    with torch.inference_mode():
        for ids, seg in batches:
            m.logits(ids, seg)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for ids, seg in batches:
                m.logits(ids, seg)
        wall = time.perf_counter() - t0
    shares: dict[str, float] = defaultdict(float)
    ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        scopes, p = [], e
        while p is not None:
            scopes.append(p.name)
            p = p.cpu_parent
        if e.name.startswith("ProfilerStep") or e.name.startswith("[memory]"):
            continue
        shares[share_of(e, scopes[1:] + [e.name])] += e.self_cpu_time_total
        ops[e.name][0] += e.self_cpu_time_total
        ops[e.name][1] += 1
    total = sum(shares.values())
    n = len(batches)
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:10]
    return {
        "batches": n,
        "profiled_wall_ms_per_forward_incl_profiler_start_stop": 1e3 * wall / n,
        "op_ms_per_forward": total / 1e3 / n,
        "shares": {k: v / total for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
        "top_ops": [
            {"op": k, "ms_per_forward": v[0] / 1e3 / n, "share": v[0] / total, "calls_per_forward": v[1] / n}
            for k, v in top
        ],
    }


def wall_ms(m: RelevanceModel, batches: list[tuple[list, list]], threads: int) -> float:
    torch.set_num_threads(threads)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for ids, seg in batches:
            m.logits(ids, seg)
        return 1e3 * (time.perf_counter() - t0) / len(batches)


def groups_per_batch(m: RelevanceModel, batches: list[tuple[list, list]]) -> float:
    w = m.module.bert.embeddings.word.weight
    return statistics.mean(len(packed.pack(ids, seg, w.device, w.dtype).groups) for ids, seg in batches)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("model/default"))
    p.add_argument("--batches", type=int, default=24, help="batches per size")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the 1- and 2-thread timings")
    p.add_argument("--pause-pid", type=int, nargs="+", help="SIGSTOP these processes while measuring")
    p.add_argument("--pause-match", help="SIGSTOP, likewise, the processes whose command line matches (pgrep -f)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the profiled forwards")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tag", default="", help="appended to the machine's slug: keeps an earlier section beside")
    p.add_argument("--render", type=Path, help="only re-render the docs section from this JSON")
    a = p.parse_args()
    if a.render:
        report = json.loads(a.render.read_text())
        update_section(DOCS, f"forward_profile:{a.render.stem.removeprefix('forward_profile-')}", render(report))
        return 0
    if a.quick:
        a.batches, a.rounds = 3, 1
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.model, dtype="auto")
    m.warm_up()
    instrument()
    data = consecutive_batches(m, SIZES, a.batches)
    report = {
        "isa_line": isa_line(isa()),
        "machine": machine(),
        "command": command_line(),
        "model": str(a.model),
        "dtype": m.dtype,
        "cpu_kernels": m.cpu_kernels,
        "sizes": {},
        "threads": {},
        "profile_threads": a.threads,
        "attention": m.attention,
    }
    with Pause(a.pause_pid, limit=float("inf"), match=a.pause_match):
        torch.set_num_threads(a.threads)
        for b in SIZES:
            r = profile_size(m, data[b])
            r["attention_groups_per_batch"] = groups_per_batch(m, data[b])
            r["mean_tokens_per_pair"] = statistics.mean(len(x) for ids, _ in data[b] for x in ids)
            report["sizes"][b] = r
            print(
                f"batch {b}: {r['op_ms_per_forward']:.1f} ms op time; "
                + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["shares"].items()),
                flush=True,
            )
        times: dict[str, list[float]] = defaultdict(list)
        for r in range(a.rounds):
            for b in SIZES:
                for t in (1, 2) if r % 2 == 0 else (2, 1):
                    times[f"{b}/{t}"].append(wall_ms(m, data[b], t))
    for b in SIZES:
        one, two = statistics.median(times[f"{b}/1"]), statistics.median(times[f"{b}/2"])
        report["threads"][b] = {
            "ms_1_thread": one,
            "ms_2_threads": two,
            "pairs_per_s_1_process_x_2_threads": 1e3 * b / two,
            "pairs_per_s_2_processes_x_1_thread_ideal": 2e3 * b / one,
            "speedup_2_threads": one / two,
            "all": {k: [round(x, 2) for x in v] for k, v in times.items() if k.startswith(f"{b}/")},
        }
    text = render(report)
    print("\n" + text)
    publish("forward_profile", slug_of(isa()) + a.tag, report, text, a.quick)
    return 0


def render(r: dict) -> str:
    sizes = list(r["sizes"])
    names: list[str] = []
    for s in r["sizes"].values():
        names += [k for k in s["shares"] if k not in names]
    lines = [
        f"### Where qtrel's default forward spends its time (`lab/forward_profile.py`, {r['machine']['date']})",
        "",
        f"torch.profiler, {r['dtype']}, unpadded, kernels {r['cpu_kernels']}, attention {r.get('attention', 'sdpa')}, "
        f"{r['profile_threads']} torch "
        "thread(s); each batch size runs "
        f"{r['sizes'][sizes[0]]['batches']} batches of consecutive dev pairs (file order: a server's mix of lengths). "
        "Share of the profiled op time (self time per op; `Python` is the self time of our own scopes).",
        f"- command: `{r['command']}`",
        "",
        "| share | " + " | ".join(f"batch {b}" for b in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for n in names:
        lines.append(f"| {n} | " + " | ".join(f"{100 * r['sizes'][b]['shares'].get(n, 0):.1f}%" for b in sizes) + " |")
    lines.append(
        "| op time per forward, ms | " + " | ".join(f"{s['op_ms_per_forward']:.1f}" for s in r["sizes"].values()) + " |"
    )
    lines.append(
        "| attention groups per batch (kernel calls per layer) | "
        + " | ".join(f"{s['attention_groups_per_batch']:.1f}" for s in r["sizes"].values())
        + " |"
    )
    lines.append(
        "| mean tokens per pair | " + " | ".join(f"{s['mean_tokens_per_pair']:.1f}" for s in r["sizes"].values()) + " |"
    )
    for b, s in r["sizes"].items():
        lines += [
            "",
            f"Top 10 ops at batch {b} (self time):",
            "",
            "| op | ms per forward | share | calls per forward |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| `{o['op']}` | {o['ms_per_forward']:.2f} | {100 * o['share']:.1f}% | {o['calls_per_forward']:.0f} |"
            for o in s["top_ops"]
        ]
    lines += [
        "",
        "Thread layout, same batches without the profiler (median ms per forward):",
        "",
        "| batch | 1 thread | 2 threads | 2-thread speed-up | 1 process × 2 threads, pairs/s "
        "| 2 processes × 1 thread (ideal), pairs/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for b, t in r["threads"].items():
        lines.append(
            f"| {b} | {t['ms_1_thread']:.1f} | {t['ms_2_threads']:.1f} | {t['speedup_2_threads']:.2f} | "
            f"{t['pairs_per_s_1_process_x_2_threads']:.0f} | {t['pairs_per_s_2_processes_x_1_thread_ideal']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
