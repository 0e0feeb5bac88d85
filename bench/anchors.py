"""qtrel's model path against the anchors measured on the machine at hand, in the same run (issue 20).

Prints the CPU's ISA line, then times, on the same length-sorted batches of 32 held-out Home Depot dev
pairs (tokenisation not timed), qtrel's modes beside transformers fp32 and bf16, ONNX Runtime and
OpenVINO with the LATENCY hint and the THROUGHPUT hint (an async infer queue) in the precision this
machine runs natively; plus qtrel at its own batches (`encoded_logits`, the server's 8192-token budget).
A matmul probe per precision (a bare linear of MiniLM's FFN shapes) runs in every repeat beside them,
and every row gets its share of the probe of its precision, in useful GFLOP/s (real tokens only).
Systems and probes are interleaved within each repeat, the order rotated per repeat; median and range.

  python bench/anchors.py --model model/default                      # full run, into docs/
  python bench/anchors.py --quick                                    # smoke run: a tiny random checkpoint
  python bench/anchors.py --model model/default --pause-pid PID      # SIGSTOP PID during each repeat only
  python bench/anchors.py --model model/default --pause-match 'qtrel train'   # ... whatever matches, then
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import warnings
from pathlib import Path

import torch
from harness.data import DEFAULT_MODEL, make_batches, read_pairs, tiny_checkpoint, useful_flops
from harness.interleave import Pause, measure, spread
from harness.machine import cpu_kind, default_title, isa, isa_line, native_precision
from harness.passes import Pass, hf_pass, openvino_passes, ort_pass, probe_pass, qtrel_batches, qtrel_own, qtrel_workers
from harness.publish import DOCS, command_line, machine, publish, update_section
from harness.systems import export_onnx, hf_model

from model.kernels import per_group_attention
from model.relevance import RelevanceModel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: model/default; --quick: a tiny random one)")
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--probe-seconds", type=float, default=2.0)
    p.add_argument(
        "--pause-pid", type=int, nargs="+", help="SIGSTOP these processes during each repeat (SIGCONT after)"
    )
    p.add_argument("--pause-match", help="SIGSTOP, likewise, the processes whose command line matches (pgrep -f)")
    p.add_argument("--title", help="section title (default: from the ISA)")
    p.add_argument("--skip", action="append", default=[], help="leave out the systems whose name starts so")
    p.add_argument("--tag", default="", help="a label kept in the JSON (the table is this kind's at these threads)")
    p.add_argument("--render", type=Path, help="only re-render the docs table from this JSON")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, 64 pairs, 1 repeat, scratch")
    a = p.parse_args()
    tmp_model = tempfile.TemporaryDirectory(prefix="qtrel-anchors-model-")
    if a.quick:
        a.pairs, a.repeats, a.probe_seconds = min(a.pairs, 64), 1, 0.1
        a.model = a.model or tiny_checkpoint(Path(tmp_model.name) / "tiny")
    a.model = a.model or DEFAULT_MODEL
    if a.render:
        report = json.loads(a.render.read_text())
        text = render(report, a.title or default_title(report["isa"]))
        update_section(DOCS, name_of(report["threads"]), report.get("kind") or cpu_kind(), text)
        return 0
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    cpu = isa()
    print("ISA: " + isa_line(cpu), flush=True)
    prec = native_precision(cpu)
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[prec]

    m_bf = RelevanceModel.load(a.model, dtype=prec)  # the default path: oneDNN linears, unpadded
    m_bf.warm_up()
    m_pad = RelevanceModel.load(a.model, dtype=prec, unpadded=False)
    m_f32 = RelevanceModel.load(a.model, dtype="float32")
    m_f32.warm_up()
    cfg, tok = m_bf.cfg, m_bf.tokenizer
    pairs = read_pairs(a.pairs)
    enc = tok.encode([q for q, _ in pairs], [t for _, t in pairs])
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    chunks = [order[i : i + 32] for i in range(0, len(order), 32)]
    lists = [([enc.input_ids[i] for i in c], [enc.token_type_ids[i] for i in c]) for c in chunks]
    batches = make_batches(tok, pairs)  # the same chunks, padded (make_batches sorts the same way)
    flops = useful_flops(cfg, enc.lengths)
    print(
        f"{len(pairs)} pairs, {len(batches)} batches of 32, {sum(enc.lengths)} tokens, "
        f"{flops / 1e9:.1f} useful GFLOP per pass"
    )

    short = {"bfloat16": "bf16", "float32": "fp32"}
    kernel_names = {"onednn-packed": "oneDNN", "fused": "fused, MKL"}  # model.kernels' choice for this CPU and dtype

    def kernels(m: RelevanceModel) -> str:
        return kernel_names.get(m.cpu_kernels, m.cpu_kernels)

    def attention(m: RelevanceModel) -> str:
        return {"math": ", math attention", "fused": ", fused attention"}.get(m.attention, "")

    def layout(m: RelevanceModel) -> str:  # many batches at once: on workers where torch has several threads
        pool = m.forward_workers()
        return "" if pool is None else f", {pool.workers} workers x {pool.threads_each} thread(s)"

    systems: dict[str, Pass] = {
        f"qtrel default ({short[prec]}, unpadded, {kernels(m_bf)}{attention(m_bf)})": qtrel_batches(
            m_bf, lists, batches, padded=False
        ),
        f"qtrel padded ({short[prec]}, {kernels(m_pad)})": qtrel_batches(m_pad, lists, batches, padded=True),
        f"qtrel own batches ({short[prec]}, encoded_logits, 8192 tokens{layout(m_bf)})": qtrel_own(m_bf, enc, order),
    }
    # the attention kernel this CPU does not ship, in the same run (model.kernels.choose_attention): where the
    # fused kernel serves, the per-group kernel it beat; else the other per-group one
    grouped = per_group_attention(getattr(torch, prec))
    other = grouped if m_bf.attention == "fused" else "sdpa" if m_bf.attention == "math" else "math"
    m_other = RelevanceModel.load(a.model, dtype=prec)
    m_other.use_attention(other)
    m_other.warm_up()
    other_name = {"sdpa": "flash attention", "math": "math attention"}[other]  # per group of similar length
    systems[f"qtrel default, {other_name} ({short[prec]}, unpadded, {kernels(m_other)})"] = qtrel_batches(
        m_other, lists, batches, padded=False
    )
    if m_bf.forward_workers() is not None:
        systems[f"qtrel default, batches of 32 on workers ({short[prec]}{layout(m_bf)})"] = qtrel_workers(m_bf, lists)
    precision = {n: prec for n in systems}
    if prec != "float32":
        systems[f32_name := f"qtrel fp32 (unpadded, {kernels(m_f32)})"] = qtrel_batches(m_f32, lists, batches, False)
        precision[f32_name] = "float32"
    notes: dict[str, str] = {}
    m_ov = RelevanceModel.load(a.model, dtype=prec)  # qtrel's own OpenVINO forward (QTREL_INFERENCE=openvino)
    m_ov.use_inference("openvino")
    if m_ov.inference == "openvino":
        m_ov.warm_up()
        ov_name = f"qtrel inference=openvino ({short[prec]}, groups of similar length)"
        systems[ov_name] = qtrel_batches(m_ov, lists, batches, padded=False)
        systems[f"qtrel inference=openvino own batches ({short[prec]}, 8192 tokens)"] = qtrel_own(m_ov, enc, order)
        precision |= {n: prec for n in systems if n.startswith("qtrel inference=openvino")}
    else:
        notes["qtrel inference=openvino"] = f"not measured: {m_ov.inference_reason}"
    m_q = RelevanceModel.load(a.model, dtype="int8")  # the checkpoint's static int8 plan (qtrel quantize)
    m_q.use_inference("openvino")
    q_name = "qtrel int8 (int8.json on OpenVINO, groups of similar length)"
    if m_q.inference == "openvino":
        systems[q_name] = qtrel_batches(m_q, lists, batches, padded=False)
        precision[q_name] = "int8"
        notes[q_name] = m_q.inference_reason
    else:
        notes[q_name] = f"not measured: {m_q.inference_reason}"
    hf32 = hf_model(a.model, "sdpa")
    systems["transformers fp32 (sdpa)"] = hf_pass(hf32, batches)
    precision["transformers fp32 (sdpa)"] = "float32"
    if prec == "bfloat16":
        systems["transformers .to(bfloat16) (sdpa)"] = hf_pass(hf_model(a.model, "sdpa").to(torch.bfloat16), batches)
        precision["transformers .to(bfloat16) (sdpa)"] = "bfloat16"
    versions = {"torch": str(torch.__version__)}
    with tempfile.TemporaryDirectory(prefix="qtrel-anchors-") as tmp:
        work = Path(tmp)
        sample = batches[len(batches) // 2]
        try:
            import onnxruntime
            from onnxruntime.transformers.optimizer import optimize_model

            versions["onnxruntime"] = onnxruntime.__version__
            raw = export_onnx(hf_model(a.model, "eager"), sample, work / "eager.onnx", dynamo=False)
            opt = optimize_model(
                str(raw), model_type="bert", num_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size
            )
            opt.save_model_to_file(str(work / "fused.onnx"))
            fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
            systems["ONNX Runtime fp32 (BERT-fused graph)"] = ort_pass(work / "fused.onnx", a.threads, batches)
            precision["ONNX Runtime fp32 (BERT-fused graph)"] = "float32"
            notes["ONNX Runtime"] = "fp32 (its CPU provider has no bf16 matmul path); fused " + ", ".join(
                f"{k} x{v}" for k, v in fused.items()
            )
        except Exception as e:
            notes["ONNX Runtime"] = f"not measured: {type(e).__name__}: {e}"[:300]
            raw = None
        try:
            if raw is None:
                raise RuntimeError("no ONNX export to read")
            lat, thr, info = openvino_passes(raw, a.threads, prec, batches)
            versions["openvino"] = info["version"]
            systems[f"OpenVINO {short[prec]}, LATENCY hint"] = lat
            systems[f"OpenVINO {short[prec]}, THROUGHPUT hint (async queue)"] = thr
            precision[f"OpenVINO {short[prec]}, LATENCY hint"] = prec
            precision[f"OpenVINO {short[prec]}, THROUGHPUT hint (async queue)"] = prec
            notes["OpenVINO"] = f"LATENCY {info['latency']}; THROUGHPUT {info['throughput']}"
        except Exception as e:
            notes["OpenVINO"] = f"not measured: {type(e).__name__}: {e}"[:300]
        import transformers

        versions["transformers"] = transformers.__version__
        probes = {"float32": probe_pass(cfg, torch.float32, a.probe_seconds)}
        if prec == "bfloat16":
            probes["bfloat16"] = probe_pass(cfg, tdt, a.probe_seconds)
        probes = {f"probe {k}": v for k, v in probes.items()}
        systems = {n: f for n, f in systems.items() if not any(n.startswith(x) for x in a.skip)}
        print("systems: " + "; ".join(systems), flush=True)
        runs, probe_runs, load = measure(systems, probes, a.repeats, Pause(a.pause_pid, match=a.pause_match))
    del systems
    gc.collect()

    precision = {n: v for n, v in precision.items() if n in runs}
    ref = runs[next(n for n in runs if n.startswith("qtrel default"))]["logits"]
    ref32 = runs["transformers fp32 (sdpa)"]["logits"] if "transformers fp32 (sdpa)" in runs else None  # --skip
    rows = {}
    for name, r in runs.items():
        pps = [len(pairs) / s for s in r["seconds"]]
        probe = probe_runs.get(f"probe {precision[name]}") or probe_runs[f"probe {prec}"]  # int8: the float probe
        share = [flops / s / 1e9 / pg for s, pg in zip(r["seconds"], probe)]
        rows[name] = {
            "precision": precision[name],
            "pairs_per_s": spread(pps),
            "useful_gflops": flops / statistics.median(r["seconds"]) / 1e9,
            "probe_share": spread(share),
            "seconds": [round(s, 3) for s in r["seconds"]],
            "cpu_seconds": [round(s, 3) for s in r["cpu_seconds"]],
            "pairs_per_cpu_s": len(pairs) / statistics.median(r["cpu_seconds"]),
            "warmup_s": round(r["warmup_s"], 2),
            "max_abs_logit_diff_vs_transformers_fp32": None
            if ref32 is None
            else (r["logits"] - ref32).abs().max().item(),
            "same_level_as_qtrel_default": (r["logits"].argmax(-1) == ref.argmax(-1)).float().mean().item(),
        }
    anchors = {n for n in rows if not n.startswith("qtrel")}
    for row in rows.values():
        kind = prec if row["precision"] == "int8" else row["precision"]  # int8 against the fastest float anchor
        same = [n for n in anchors if rows[n]["precision"] == kind]
        if same:
            best = max(same, key=lambda n: rows[n]["pairs_per_s"]["median"])
            row["best_anchor"] = best
            row["x_best_anchor"] = row["pairs_per_s"]["median"] / rows[best]["pairs_per_s"]["median"]
            bests = [max(rows[n]["pairs_per_s"]["all"][r] for n in same) for r in range(a.repeats)]
            row["x_best_anchor_per_repeat"] = [round(v / b, 3) for v, b in zip(row["pairs_per_s"]["all"], bests)]
    report = {
        "isa": cpu,
        "isa_line": isa_line(cpu),
        "native_precision": prec,
        "machine": machine(),
        "command": command_line(),
        "model": str(a.model),
        "pairs": len(pairs),
        "batches": len(batches),
        "tokens": sum(enc.lengths),
        "useful_gflop_per_pass": flops / 1e9,
        "threads": a.threads,
        "repeats": a.repeats,
        "paused_pid": a.pause_pid,
        "paused_match": a.pause_match,
        "load": load,
        "versions": versions,
        "probe_gflops": {k: spread(v) for k, v in probe_runs.items()},
        "rows": rows,
        "notes": notes,
        "quick": a.quick,
        "tag": a.tag,
    }
    text = render(report, a.title or default_title(cpu))
    print("\n" + text)
    publish(name_of(a.threads), report, text, a.quick)
    tmp_model.cleanup()
    return 0


def name_of(threads: int) -> str:
    """One table per thread count and machine kind: anchors-1thread, anchors-2threads."""
    return f"anchors-{threads}thread{'s' if threads > 1 else ''}"


def load_note(r: dict) -> str:
    """What else ran: a paused process counts in the load average but took no CPU while timed."""
    paused = [str(p) for p in r.get("paused_pid") or []] + ([f"'{r['paused_match']}'"] if r.get("paused_match") else [])
    if paused:
        return f"other jobs ({', '.join(paused)}) stopped with SIGSTOP for the timed part of each repeat"
    return "whatever else ran on the machine shared its cores (nothing was paused)"


def render(r: dict, title: str) -> str:
    m = r["machine"]
    pr = r["probe_gflops"]
    lines = [
        f"### Anchors: {title.removeprefix('Anchors: ')} (`bench/anchors.py`)",  # a --title may carry it too
        "",
        f"- run: {m['date']}, {r['threads']} thread(s), {r['pairs']} dev pairs in {r['batches']} batches, "
        f"{r['repeats']} repeats (median, range); " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        f"- command: `{r['command']}`",
        "- matmul probe, GFLOP/s: "
        + "; ".join(
            f"{k.removeprefix('probe ')} {v['median']:.0f} ({v['min']:.0f}–{v['max']:.0f})" for k, v in pr.items()
        )
        + f"; {r['useful_gflop_per_pass']:.0f} useful GFLOP per pass of {r['tokens']} tokens",
        f"- load: {load_note(r)}; load average after each repeat: "
        + ", ".join(f"{x['loadavg_1min_after']:.1f}" for x in r["load"]),
        "",
        "| system | precision | pairs/s | useful GFLOP/s | share of the probe | × best anchor, same precision "
        "(of medians; per repeat: median, range) | pairs per CPU-s | × best anchor per CPU-s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    rows = r["rows"]
    anchors = [n for n in rows if not n.startswith("qtrel")]
    for name, s in r["rows"].items():
        p, sh = s["pairs_per_s"], s["probe_share"]
        x, xc = "—", "—"
        if "x_best_anchor" in s:
            per = s["x_best_anchor_per_repeat"]
            x = f"{s['x_best_anchor']:.2f} ({statistics.median(per):.2f}; {min(per):.2f}–{max(per):.2f})"
            same = [n for n in anchors if rows[n]["precision"] == rows[s["best_anchor"]]["precision"]]
            xc = f"{s['pairs_per_cpu_s'] / max(rows[n]['pairs_per_cpu_s'] for n in same):.2f}"
        bold = "**" if name.startswith("qtrel default") or name.startswith("qtrel own") else ""
        lines.append(
            f"| {bold}{name}{bold} | {s['precision']} | {p['median']:,.0f} ({p['min']:,.0f}–{p['max']:,.0f}) | "
            f"{s['useful_gflops']:.0f} | {100 * sh['median']:.0f}% ({100 * sh['min']:.0f}–{100 * sh['max']:.0f}) "
            f"| {x} | {s['pairs_per_cpu_s']:.0f} | {xc} |"
        )
    lines.append("")
    for name, why in r["notes"].items():
        if name != "OpenVINO" or why.startswith("not measured"):  # its properties stay in the JSON
            lines.append(f"- {name}: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
