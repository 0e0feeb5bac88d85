"""Model throughput on CPU: our encoder beside `transformers` and ONNX Runtime, on real Home Depot pairs.

Every system scores the same length-sorted batches of 32 dev pairs, given the same padded tensors
(tokenisation is not timed). Systems alternate within each repeat (the order rotates per repeat) so
that machine noise falls on all of them alike; a system's figure is the median of the repeats. The
float32 matmul peak of this machine is measured in the same run, and each forward's FLOPs come from the
model shapes and the padded token counts, so every system also gets a "fraction of peak".

  python bench/model_speed.py                       # full run (tens of minutes on 2 cores), into docs/benchmarks.md
  python bench/model_speed.py --quick               # smoke run: a tiny random checkpoint, into a scratch folder
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness.data import (
    BATCH,
    Batch,
    base_checkpoint,
    forward_flops,
    make_batches,
    minilm_checkpoint,
    read_pairs,
    tiny_checkpoint,
)
from harness.machine import default_title, isa
from harness.publish import command_line, machine, machine_lines, publish, verdict
from harness.systems import export_onnx, hf_model, ort_fused_graph, ort_session

from model.config import BertConfig
from model.onednn import OneDNNLinear
from model.relevance import RelevanceModel, level_values

TARGETS = {"vs_transformers": 1.6, "vs_ort": 0.9, "low_precision_speedup": 1.5, "same_level": 0.97, "spearman": 0.99}


# --- systems: each maps a Batch to (B, levels) float32 logits ------------------------------------
System = Callable[[Batch], torch.Tensor]


def ours(path: Path, dtype: str, fast: bool) -> System:  # fast: oneDNN linears and batches without padding
    m = RelevanceModel.load(path, dtype=dtype, onednn=fast, unpadded=fast)

    def run(b: Batch) -> torch.Tensor:
        with torch.inference_mode():
            return m.module(b.ids, b.seg, b.mask)[0].float()

    return run


def transformers_system(hf) -> System:
    def run(b: Batch) -> torch.Tensor:
        with torch.inference_mode():
            return hf(input_ids=b.ids, attention_mask=b.mask, token_type_ids=b.seg).logits

    return run


def ort_system(path: Path, threads: int) -> System:
    sess, inputs = ort_session(path, threads)

    def run(b: Batch) -> torch.Tensor:
        feeds = b.feeds()
        return torch.from_numpy(sess.run(None, {k: feeds[k] for k in inputs})[0])

    return run


def build_systems(path: Path, cfg: BertConfig, sample: Batch, threads: int, work: Path):
    """All systems for one checkpoint, and notes: systems that could not be built, ORT's fusions."""
    systems: dict[str, System] = {
        "ours float32 unpacked": ours(path, "float32", fast=False),
        "ours float32": ours(path, "float32", fast=True),
        "ours bfloat16": ours(path, "bfloat16", fast=True),
        "ours int8": ours(path, "int8", fast=False),
    }
    hf = hf_model(path, "sdpa")
    systems["transformers"] = transformers_system(hf)
    notes: dict[str, str] = {}
    if importlib.util.find_spec("onnxruntime") is None:  # no exports to run: note it and go on
        notes["ORT"] = "not measured: onnxruntime is not installed (pip install -e '.[bench]')"
        return systems, notes
    try:  # the plain export of the same sdpa model, ORT's own graph optimisations
        systems["ORT"] = ort_system(export_onnx(hf, sample, work / "model.onnx", dynamo=True), threads)
    except Exception as e:  # report and go on: the other systems still measure
        notes["ORT"] = f"not measured: {type(e).__name__}: {e}"[:300]
    try:  # the strongest ORT setup we know: eager graph, ORT's BERT fusions (Attention, SkipLayerNorm, ...)
        graph, fused = ort_fused_graph(path, cfg, sample, work)
        systems["ORT fused"] = ort_system(graph, threads)
        notes["ORT fused graph"] = "fused " + ", ".join(f"{k} x{v}" for k, v in fused.items())
    except Exception as e:
        notes["ORT fused"] = f"not measured: {type(e).__name__}: {e}"[:300]
    return systems, notes


# --- float32 matmul peak -------------------------------------------------------------------------
def best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ort_matmul(b: torch.Tensor) -> bytes:
    """An ONNX graph of one MatMul by the constant `b`, serialised."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = b.shape[0]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "B"], ["C"])],
        "matmul",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [n, n])],
        [numpy_helper.from_array(b.numpy(), "B")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def matmul_peak(n: int, threads: int, reps: int) -> dict:
    """GFLOP/s of an n x n float32 matmul: torch.mm, a pre-packed oneDNN linear, an ORT MatMul (where ONNX
    Runtime is installed)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    packed = OneDNNLinear(b, torch.zeros(n))
    flops = 2.0 * n**3
    with torch.inference_mode():
        gflops = {
            "torch.mm": flops / best_seconds(lambda: torch.mm(a, b), reps) / 1e9,
            "oneDNN packed linear": flops / best_seconds(lambda: packed(a), reps) / 1e9,
        }
    try:
        sess, _ = ort_session(ort_matmul(b), threads)
    except ImportError:
        return {"n": n, "gflops": gflops, "peak_gflops": max(gflops.values())}
    a_np = a.numpy()
    gflops["ORT MatMul"] = flops / best_seconds(lambda: sess.run(None, {"A": a_np}), reps) / 1e9
    return {"n": n, "gflops": gflops, "peak_gflops": max(gflops.values())}


# --- measurement ---------------------------------------------------------------------------------
def timed_pass(fn: System, batches: list[Batch]) -> tuple[float, torch.Tensor]:
    outs = []
    t0 = time.perf_counter()
    for b in batches:
        outs.append(fn(b))
    return time.perf_counter() - t0, torch.cat(outs).float()


def measure(systems: dict[str, System], batches: list[Batch], repeats: int) -> dict[str, dict]:
    """Seconds per pass for each system, interleaved, after one full warm-up pass (every batch shape
    once: oneDNN and ORT prepare kernels per shape) that also gives the logits."""
    out: dict[str, dict[str, Any]] = {}
    for n, fn in systems.items():
        out[n] = {"seconds": [], "logits": timed_pass(fn, batches)[1]}
    names = list(systems)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name]["seconds"].append(timed_pass(systems[name], batches)[0])
        print(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{n} {out[n]['seconds'][-1]:.2f}s" for n in names))
    return out


def agreement(ref: torch.Tensor, other: torch.Tensor, values: torch.Tensor) -> dict:
    from scipy.stats import spearmanr

    same = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
    rho = spearmanr((ref.softmax(-1) @ values).numpy(), (other.softmax(-1) @ values).numpy()).statistic
    return {"same_level": same, "spearman": float(rho)}


def bench_model(label: str, path: Path, n_pairs: int, args, peak: float, work: Path, quality: bool) -> dict:
    m = RelevanceModel.load(path, onednn=False, unpadded=False)
    cfg, labels = m.cfg, m.labels
    batches = make_batches(m.tokenizer, read_pairs(n_pairs))
    del m
    flops = sum(forward_flops(cfg, *b.ids.shape) for b in batches)
    tokens = sum(int(b.mask.sum()) for b in batches)
    padded = sum(b.ids.numel() for b in batches)
    print(
        f"{label}: {n_pairs} pairs in {len(batches)} batches, {tokens} tokens ({padded} padded), "
        f"{flops / 1e9:.1f} GFLOP per pass"
    )
    systems, notes = build_systems(path, cfg, batches[len(batches) // 2], args.threads, work)
    runs = measure(systems, batches, args.repeats)
    del systems
    gc.collect()
    ref_hf = runs["transformers"]["logits"]
    pps = {n: n_pairs / statistics.median(r["seconds"]) for n, r in runs.items()}
    rows = {}
    for name, r in runs.items():
        gfs = flops / statistics.median(r["seconds"]) / 1e9
        rows[name] = {
            "pairs_per_s": pps[name],
            "seconds": [round(x, 4) for x in r["seconds"]],
            "gflops": gfs,
            "peak_fraction": gfs / peak,
            "max_abs_logit_diff_vs_transformers": (r["logits"] - ref_hf).abs().max().item(),
        }
        for ref in ("transformers", "ORT", "ORT fused"):
            if ref in pps and name != ref:
                rows[name][f"x_{ref}"] = pps[name] / pps[ref]
    result = {
        "label": label,
        "checkpoint": str(path),
        "pairs": n_pairs,
        "batches": len(batches),
        "tokens": tokens,
        "padded_tokens": padded,
        "gflop_per_pass": flops / 1e9,
        "config": cfg.to_dict(),
        "systems": rows,
        "notes": notes,
    }
    if quality:
        values = level_values(labels)
        ref = runs["ours float32"]["logits"]
        result["quality"] = {n: agreement(ref, runs[n]["logits"], values) for n in ("ours bfloat16", "ours int8")}
    result["targets"] = targets(result)
    return result


def targets(r: dict) -> list[dict]:
    s = r["systems"]
    f32 = s["ours float32"]["pairs_per_s"]
    out = [
        (
            f"ours float32 >= {TARGETS['vs_transformers']}x transformers ({s['ours float32']['x_transformers']:.2f}x)",
            s["ours float32"]["x_transformers"] >= TARGETS["vs_transformers"],
        )
    ]
    orts = [k for k in ("ORT", "ORT fused") if k in s]
    if orts:
        best = max(orts, key=lambda k: s[k]["pairs_per_s"])
        x = f32 / s[best]["pairs_per_s"]
        out.append((f"ours float32 >= {TARGETS['vs_ort']}x ORT (best: {best}, {x:.2f}x)", x >= TARGETS["vs_ort"]))
    for mode in ("ours bfloat16", "ours int8"):
        x = s[mode]["pairs_per_s"] / f32
        out.append(
            (
                f"{mode} >= {TARGETS['low_precision_speedup']}x ours float32 ({x:.2f}x)",
                x >= TARGETS["low_precision_speedup"],
            )
        )
    for mode, q in r.get("quality", {}).items():
        out.append(
            (
                f"{mode}: same level as float32 >= {TARGETS['same_level']} ({q['same_level']:.4f})",
                q["same_level"] >= TARGETS["same_level"],
            )
        )
        out.append(
            (
                f"{mode}: Spearman vs float32 >= {TARGETS['spearman']} ({q['spearman']:.4f})",
                q["spearman"] >= TARGETS["spearman"],
            )
        )
    return [{"target": text, "pass": ok} for text, ok in out]


# --- report --------------------------------------------------------------------------------------
def render(report: dict) -> str:
    p = report["peak"]
    lines = [
        f"### Model throughput: {report.get('title') or report['machine']['cpu']} (`bench/model_speed.py`)",
        "",
        f"Batches of {BATCH} length-sorted dev pairs, the same padded tensors for every system; median of "
        f"{report['repeats']} interleaved repeats; {report['threads']} threads (torch = ORT intra-op).",
        "",
        *machine_lines(report["machine"], report["command"]),
        f"- float32 matmul peak ({p['n']}x{p['n']}): "
        + ", ".join(f"{k} {v:.0f}" for k, v in p["gflops"].items())
        + f" GFLOP/s; peak = {p['peak_gflops']:.0f} GFLOP/s. FLOPs per forward = layers x (2T(4H² + 2HI) + 4TtH) "
        "+ pooler and head, T = padded tokens, t = padded length.",
    ]
    for r in report["models"]:
        lines += [
            "",
            f"#### {r['label']}",
            "",
            f"{r['pairs']} pairs, {r['batches']} batches, {r['tokens']} tokens ({r['padded_tokens']} padded), "
            f"{r['gflop_per_pass']:.1f} GFLOP per pass.",
            "",
            "| system | pairs/s | x transformers | x ORT | x ORT fused | GFLOP/s | % of fp32 peak "
            "| max abs logit diff vs transformers |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, s in r["systems"].items():
            xs = [f"{s[k]:.2f}" if k in s else "—" for k in ("x_transformers", "x_ORT", "x_ORT fused")]
            lines.append(
                f"| {name} | {s['pairs_per_s']:.0f} | {' | '.join(xs)} | {s['gflops']:.0f} | "
                f"{100 * s['peak_fraction']:.0f}% | {s['max_abs_logit_diff_vs_transformers']:.1e} |"
            )
        for name, why in r["notes"].items():
            lines.append(f"\n{name}: {why}")
        if "quality" in r:
            lines += ["", "| mode vs ours float32 | same predicted level | Spearman of scores |", "|---|---:|---:|"]
            lines += [f"| {n} | {q['same_level']:.4f} | {q['spearman']:.4f} |" for n, q in r["quality"].items()]
        lines += [""] + [f"- {verdict(t['pass'])}: {t['target']}" for t in r["targets"]]
    lines += ["", *[f"- {n}" for n in report["notes"]]]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="trained checkpoint to use instead of MiniLM with a seeded 5-level head")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (= ORT intra-op threads)")
    p.add_argument("--pairs", type=int, default=4000, help="dev pairs for the small model")
    p.add_argument("--base-pairs", type=int, default=1000, help="dev pairs for the BERT-base-sized model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-base", action="store_true", help="skip the BERT-base-sized model")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a tiny random checkpoint, 64 pairs, 1 repeat, no base model, into a scratch folder",
    )
    a = p.parse_args()
    if a.quick:
        a.pairs, a.base_pairs, a.repeats, a.no_base = min(a.pairs, 64), min(a.base_pairs, 32), 1, True
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.ao")  # int8's deprecation notice
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # the exporter's notes on torchvision ops
    report = {
        "machine": machine(),
        "title": default_title(isa()),
        "command": command_line(),
        "threads": a.threads,
        "repeats": a.repeats,
        "quick": a.quick,
        "models": [],
    }
    import transformers

    report["versions"] = {"transformers": transformers.__version__}
    try:
        import onnxruntime

        report["versions"]["onnxruntime"] = onnxruntime.__version__
    except ImportError:  # the ORT rows and the ORT MatMul are then noted as not measured
        pass
    n = 512 if a.quick else 2048
    report["peak"] = peak = matmul_peak(n, a.threads, reps=3 if a.quick else 10)
    print(f"float32 matmul peak {n}x{n}: " + ", ".join(f"{k} {v:.0f}" for k, v in peak["gflops"].items()) + " GFLOP/s")
    layers = 1 if a.quick else 12
    with tempfile.TemporaryDirectory(prefix="qtrel-bench-") as tmp:
        work = Path(tmp)
        if a.quick and not a.model:
            a.model = tiny_checkpoint(work / "tiny")
        small = a.model or minilm_checkpoint(work / "minilm-seeded")
        small_label = f"(a) {a.model} (--model)" if a.model else "(a) MiniLM-L6 (H384, 6 layers) + seeded 5-level head"
        (work / "a").mkdir()
        report["models"].append(bench_model(small_label, small, a.pairs, a, peak["peak_gflops"], work / "a", True))
        if not a.no_base:
            (work / "b").mkdir()
            base = base_checkpoint(work / "bert-base-random", layers)
            label = f"(b) BERT-base-sized, random weights ({layers} layers, H768, 12 heads, I3072)"
            report["models"].append(bench_model(label, base, a.base_pairs, a, peak["peak_gflops"], work / "b", False))
    report["notes"] = [
        f"(b) uses {a.base_pairs} pairs (not {a.pairs}) to bound the run time; its weights are random, so only "
        "its speed means anything.",
        "Quality: the bfloat16 and int8 modes against our float32 on (a), same pairs."
        + (
            ""
            if a.model
            else " The head is seeded, not trained: its levels sit close together, so a run with "
            "--model (a trained checkpoint) is the meaningful check."
        ),
    ]
    if a.quick:
        report["notes"].append("--quick smoke run: tiny sizes, numbers are not benchmarks.")
    text = render(report)
    print("\n" + text)
    publish("model_speed", report, text, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
