"""Can an int8 linear pay on this CPU (issue 20)? MiniLM's linear shapes, the shipped bfloat16 oneDNN linear
against every int8 kernel this torch offers, with the cost of quantising the activation counted.

Shapes: q/k/v fused 384 -> 1152, attention output 384 -> 384, FFN up 384 -> 1536 with GELU, FFN down
1536 -> 384, each at `--rows` token rows (the packed forward feeds the linears (tokens, features)). Input and
output are bfloat16 as between the shipped model's layers, except where a kernel takes only float32 (said
in its name). Variants:
  - `bf16 oneDNN (shipped)`: `model.engines.onednn.OneDNNLinear`, pre-packed, GELU fused;
  - `_int_mm kernel`: `torch._int_mm` s8 x s8 -> s32 alone, operands already int8 (the bound, not a path);
  - `_int_mm per-token`: per-token dynamic symmetric int8 activations, per-channel weights (the scheme that
    kept 98.05% of levels, `lab/int8_tradeoff.py`), quantise + `_int_mm` + rescale, bias, GELU in eager;
  - `_int_mm per-token, torch.compile`: the same function under inductor, which fuses the quantise prologue
    and the rescale epilogue around `_int_mm` (one compile per shape, rows dynamic; `--no-compile` skips it);
  - `qlinear kernel`: `torch.ops.onednn.qlinear_pointwise` (pre-packed s8 weights, per-channel scales, bias,
    GELU and the bf16 output fused), activation already int8 (a static, calibrated per-tensor scale whose
    quantisation a producer fused: the bound of any oneDNN int8 graph);
  - `qlinear per-tensor dynamic`: the same with the activation's scale (amax) computed and the activation
    quantised in eager before it (oneDNN takes one activation scale: per-token is refused);
  - `linear_dynamic x86 (fp32)`: `torch.ops.quantized.linear_dynamic` (qtrel's `--dtype int8` today, fbgemm,
    per-tensor dynamic quantisation inside the op), float32 in and out, GELU after it;
  - `ORT DynamicQuantizeMatMul (fp32)`: ONNX Runtime's fused dynamic-quantising matmul (MLAS, u8 x s8,
    per-tensor activations, per-column weights), float32, GELU (com.microsoft BiasGelu) fused after it;
  - `weight-only int8`: `torch._weight_int8pack_mm` (bf16 activations, int8 weights).
torchao 0.18 on CPU has no fused int8 kernel of its own (its ops are quantise/dequantise; its C++ CPU extension
is not in the wheel), so it is not a row here; its eager W8A8 is timed end to end in `lab/int8_tradeoff.py`.

All variants interleaved per repeat (order rotated), `--calls` calls each, median of `--repeats`; the
figure is GFLOP/s of the linear (2·rows·in·out per call), so a variant's quantisation counts as its time.

  python lab/int8_kernels.py [--rows 256 1024 4096] [--repeats 7] [--threads 1] [--no-compile] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from anchors import isa, isa_line, run_header, slug_of
from results import publish
from torch import Tensor

from model.engines.onednn import OneDNNLinear

SHAPES = (("qkv", 384, 1152, False), ("attn out", 384, 384, False), ("FFN up +GELU", 384, 1536, True),
          ("FFN down", 1536, 384, False))  # fmt: skip
BF16 = "bf16 oneDNN (shipped)"


def per_channel(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 weight (out, in) and its per-output-channel scale (out,)."""
    s = w.abs().amax(1).clamp(min=1e-12) / 127
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def ort_session(wq: Tensor, ws: Tensor, bias: Tensor, gelu: bool, threads: int):
    """An ONNX Runtime session of DynamicQuantizeMatMul (+ BiasGelu), or None where ORT is absent."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    k, m = wq.shape[1], wq.shape[0]
    inits = [
        numpy_helper.from_array(wq.t().contiguous().numpy(), "B"),
        numpy_helper.from_array(ws.float().numpy(), "b_scale"),
        numpy_helper.from_array(torch.zeros(m, dtype=torch.int8).numpy(), "b_zp"),
        numpy_helper.from_array(bias.float().numpy(), "bias"),
    ]
    if gelu:
        nodes = [
            helper.make_node("DynamicQuantizeMatMul", ["A", "B", "b_scale", "b_zp"], ["mm"], domain="com.microsoft"),
            helper.make_node("BiasGelu", ["mm", "bias"], ["Y"], domain="com.microsoft"),
        ]
    else:
        nodes = [
            helper.make_node(
                "DynamicQuantizeMatMul", ["A", "B", "b_scale", "b_zp", "bias"], ["Y"], domain="com.microsoft"
            )
        ]
    graph = helper.make_graph(
        nodes,
        "q",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["N", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", m])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def per_token_fn(gelu: bool) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The per-token W8A8 linear as one function, for inductor to fuse the quantise prologue and the
    rescale + bias (+ GELU) + bf16 epilogue around `_int_mm`."""

    def f(x: Tensor, wq_t: Tensor, ws: Tensor, b: Tensor) -> Tensor:
        xf = x.float()
        s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127  # (n, 1)
        acc = torch._int_mm(torch.round(xf / s).clamp(-127, 127).to(torch.int8), wq_t).float() * s * ws + b
        return (F.gelu(acc) if gelu else acc).bfloat16()

    return f


def variants(
    n: int, k: int, m: int, gelu: bool, threads: int, compiled: dict | None
) -> tuple[dict[str, Callable[[], Tensor]], Tensor]:
    """Zero-argument calls, one per variant, on one (n, k) bfloat16 activation; and the float32 reference."""
    g = torch.Generator().manual_seed(n * 7 + k + m)
    w = torch.randn(m, k, generator=g) * (1 / k**0.5)
    b = torch.randn(m, generator=g) * 0.1
    x = torch.randn(n, k, generator=g)
    if k == 1536:  # the down-projection reads GELU outputs
        x = F.gelu(x)
    xb = x.bfloat16()
    ref = F.linear(xb.float(), w, b)
    ref = F.gelu(ref) if gelu else ref
    act = F.gelu if gelu else (lambda t: t)
    wq, ws = per_channel(w)
    out: dict[str, Callable[[], Tensor]] = {}

    lin = OneDNNLinear(w.bfloat16(), b.bfloat16(), "gelu" if gelu else "none", "none" if gelu else "")
    out[BF16] = lambda: lin(xb)

    wq_t = wq.t().contiguous()  # (in, out), as _int_mm wants
    xs_tok = xb.float().abs().amax(-1, keepdim=True) / 127
    qx_tok = torch.round(xb.float() / xs_tok).clamp(-127, 127).to(torch.int8)
    out["_int_mm kernel"] = lambda: torch._int_mm(qx_tok, wq_t)

    def int_mm_per_token() -> Tensor:
        s = xb.abs().amax(-1, keepdim=True).clamp_(min=1e-30) / 127  # (n, 1), bf16: the fastest eager form
        qx = torch.round(xb / s).clamp_(-127, 127).to(torch.int8)
        acc = torch._int_mm(qx, wq_t).float().mul_(s.float()).mul_(ws).add_(b)  # (n, out) float32
        return act(acc).bfloat16()

    out["_int_mm per-token"] = int_mm_per_token
    if compiled is not None:
        out["_int_mm per-token, torch.compile"] = lambda: compiled[(k, m, gelu)](xb, wq_t, ws, b)

    # u8 activations only: the packed weight carries the u8 zero-point compensation, and s8 activations
    # fall to oneDNN's reference kernel (`ref_int8`, ~1000x slower; ONEDNN_VERBOSE=1 shows it)
    pw = torch.ops.onednn.qlinear_prepack(wq, [n, k])
    wzp = torch.zeros(m, dtype=torch.int64)
    bb = b.bfloat16()
    post = ("gelu", [], "none") if gelu else ("none", [], "")
    q_stat = torch.quantize_per_tensor_dynamic(xb.float(), torch.quint8, False)
    qx_stat, s_stat, zp_stat = q_stat.int_repr(), q_stat.q_scale(), q_stat.q_zero_point()
    out["qlinear kernel"] = lambda: torch.ops.onednn.qlinear_pointwise(
        qx_stat, s_stat, zp_stat, pw, ws, wzp, bb, 1.0, 0, torch.bfloat16, *post
    )

    def qlinear_dynamic() -> Tensor:
        # ATen's fused min/max + u8 quantiser, the fastest eager form measured (float32 input)
        q = torch.quantize_per_tensor_dynamic(xb.float(), torch.quint8, False)
        return torch.ops.onednn.qlinear_pointwise(
            q.int_repr(), q.q_scale(), q.q_zero_point(), pw, ws, wzp, bb, 1.0, 0, torch.bfloat16, *post
        )

    out["qlinear per-tensor dynamic"] = qlinear_dynamic

    torch.backends.quantized.engine = "x86"
    qw = torch.quantize_per_channel(w, ws.double(), torch.zeros(m, dtype=torch.int64), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, b)
    xf = xb.float()
    out["linear_dynamic x86 (fp32)"] = lambda: act(torch.ops.quantized.linear_dynamic(xf, packed))

    sess = ort_session(wq, ws, b, gelu, threads)
    if sess is not None:
        xn = xf.numpy()
        out["ORT DynamicQuantizeMatMul (fp32)"] = lambda: torch.from_numpy(sess.run(None, {"A": xn})[0])

    out["weight-only int8"] = lambda: act(torch._weight_int8pack_mm(xb, wq, ws.bfloat16()) + b.bfloat16())
    return out, ref


def time_calls(fn: Callable[[], Tensor], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=0, help="calls per timing (default: about 20 ms of bf16 work)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant (~1 min per shape)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file and the docs section")
    ap.add_argument("--quick", action="store_true", help="1 row count, 2 repeats, into /tmp/qtrel-bench-quick")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeats = args.rows[:1], 2
    torch.set_num_threads(args.threads)
    machine_isa = isa()
    print(isa_line(machine_isa), flush=True)
    results: list[dict] = []
    compiled = None
    if not args.no_compile:  # one compile per shape, rows dynamic
        compiled = {(k, m, gelu): torch.compile(per_token_fn(gelu), dynamic=True) for _, k, m, gelu in SHAPES}
    for n in args.rows:
        for label, k, m, gelu in SHAPES:
            fns, ref = variants(n, k, m, gelu, args.threads, compiled)
            flop = 2 * n * k * m
            calls = args.calls or max(2, round(20e-3 * 150e9 / flop))
            err = {}
            for name, fn in fns.items():
                t0 = time.perf_counter()
                got = fn().float()  # warm-up, and the error against float32 (a bare kernel's output is unscaled)
                if not name.endswith("kernel"):
                    err[name] = ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
                if time.perf_counter() - t0 > 5:
                    print(f"  warm-up {name}: {time.perf_counter() - t0:.0f}s", flush=True)
            secs: dict[str, list[float]] = {name: [] for name in fns}
            load = []
            names = list(fns)
            for r in range(args.repeats):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    secs[name].append(time_calls(fns[name], calls))
                load.append(round(os.getloadavg()[0], 2))
            row = {
                "shape": label, "rows": n, "in": k, "out": m, "calls": calls, "load_1min": load,
                "gflops": {name: [flop / s / 1e9 for s in v] for name, v in secs.items()},
                "rel_rmse": err,
            }  # fmt: skip
            results.append(row)
            print(
                f"{label} {n} rows (load {load[-1]:.2f}): "
                + ", ".join(f"{name} {statistics.median(v):.0f}" for name, v in row["gflops"].items()),
                flush=True,
            )
    report = {
        **run_header(machine_isa),
        "threads": args.threads,
        "repeats": args.repeats,
        "results": results,
    }
    publish("int8_kernels", slug_of(machine_isa) + args.tag, report, render(report), args.quick)
    print(render(report))
    return 0


def layer_rows(r: dict) -> list[dict]:
    """Per row count, the four linears of one encoder layer together: GFLOP/s of their summed time."""
    out = []
    for n in sorted({x["rows"] for x in r["results"]}):
        rows = [x for x in r["results"] if x["rows"] == n]
        names = [name for name in rows[0]["gflops"] if all(name in x["gflops"] for x in rows)]
        flop = sum(2 * n * x["in"] * x["out"] for x in rows)
        reps = len(rows[0]["gflops"][BF16])
        g = {}
        for name in names:
            per_rep = [
                sum(2 * n * x["in"] * x["out"] / (x["gflops"][name][i] * 1e9) for x in rows) for i in range(reps)
            ]
            g[name] = [flop / s / 1e9 for s in per_rep]
        out.append({"shape": "**one layer's 4 linears**", "rows": n, "gflops": g, "rel_rmse": {}, "load_1min": []})
    return out


def render(r: dict) -> str:
    names = list(r["results"][0]["gflops"])
    loads = [v for x in r["results"] for v in x["load_1min"]]
    lines = [
        f"### int8 kernels against the shipped bfloat16 linear: {r['isa']['microarchitecture']} "
        f"(`lab/int8_kernels.py`, {r['date']})",
        "",
        f"- ISA: {r['isa_line']}",
        f"- command: `{r['command']}`; torch {r['torch']}, {r['threads']} torch thread(s)",
        f"- GFLOP/s of the linear (2·rows·in·out per call, quantisation counted in the variant's time), median of "
        f"{r['repeats']} interleaved repeats; in brackets the relative RMS error against float32 (bf16 inputs)",
        f"- 1-minute load average during the run: {min(loads):.2f}–{max(loads):.2f} "
        f"(median {statistics.median(loads):.2f})",
        "",
        "| linear | rows | " + " | ".join(names) + " | best int8 path ÷ bf16 |",
        "|---|---:|" + "---:|" * (len(names) + 1),
    ]
    paths = [nm for nm in names if nm not in (BF16, "_int_mm kernel", "qlinear kernel")]
    for x in r["results"] + layer_rows(r):
        med = {nm: statistics.median(v) for nm, v in x["gflops"].items()}
        cells = []
        for nm in names:
            e = x["rel_rmse"].get(nm)
            cells.append(f"{med[nm]:.0f}" + (f" ({e:.1e})" if e is not None else ""))
        best = max(paths, key=med.__getitem__)
        lines.append(
            f"| {x['shape']} | {x['rows']} | " + " | ".join(cells) + f" | {med[best] / med[BF16]:.2f} ({best}) |"
        )
    lines += ["", "One layer's 4 linears, each variant ÷ bf16 (median of the per-repeat ratios):", ""]
    lines += ["| rows | " + " | ".join(names[1:]) + " |", "|---:|" + "---:|" * (len(names) - 1)]
    for x in layer_rows(r):
        g = x["gflops"]
        ratios = [statistics.median(a / b for a, b in zip(g[nm], g[BF16])) for nm in names[1:]]
        lines.append(f"| {x['rows']} | " + " | ".join(f"{v:.2f}" for v in ratios) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    warnings.filterwarnings("ignore", category=UserWarning)  # torch's deprecation notice on quantized tensors
    raise SystemExit(main())
