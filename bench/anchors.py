"""qtrel's model path against the anchors measured on the machine at hand, in the same run (issue 20).

Prints the CPU's ISA line, then times, on the same length-sorted batches of 32 held-out Home Depot dev
pairs (tokenisation not timed), qtrel's modes beside transformers fp32 and bf16, ONNX Runtime and
OpenVINO with the LATENCY hint and the THROUGHPUT hint (an async infer queue) in the precision this
machine runs natively; plus qtrel at its own batches (`encoded_logits`, the server's 8192-token budget).
A matmul probe per precision (a bare linear of MiniLM's FFN shapes) runs in every repeat beside them,
and every row gets its share of the probe of its precision, in useful GFLOP/s (real tokens only).
Systems and probes are interleaved within each repeat, the order rotated per repeat; median and range.

  python bench/anchors.py --model model/default                      # full run, into docs/
  python bench/anchors.py --model model/default --quick              # smoke run, under /tmp/qtrel-bench-quick
  python bench/anchors.py --model model/default --pause-pid PID      # SIGSTOP PID during each repeat only
  python bench/anchors.py --model model/default --pause-match 'qtrel train'   # ... whatever matches, then
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from model_speed import Batch, export_onnx, hf_model, make_batches, read_pairs
from results import DOCS, command_line, machine, publish, update_section

from model.config import BertConfig
from model.engines.kernels import per_group_attention
from model.engines.onednn import OneDNNLinear
from model.levels import MAX_BATCH_TOKENS
from model.parallel import run_batches
from model.relevance import RelevanceModel

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
PROBE_ROWS = 1024  # tokens per probe matmul: about one batch of 32 dev pairs (~26 tokens each)


# --- the machine ---------------------------------------------------------------------------------
def isa() -> dict:
    info = Path("/proc/cpuinfo").read_text(errors="ignore").splitlines()
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info[:40]) if v}
    flags = set(field.get("flags", "").split())
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except (OSError, subprocess.CalledProcessError):
        name = field.get("model name", "?")
    fam, mod = int(field.get("cpu family", 0)), int(field.get("model", 0))
    return {
        "model_name": name,
        "vendor": field.get("vendor_id", "?"),
        "family": fam,
        "model": mod,
        "microarchitecture": microarchitecture(field.get("vendor_id", ""), fam, mod, flags),
        "flags": {f: f in flags for f in ISA_FLAGS},
    }


def microarchitecture(vendor: str, fam: int, mod: int, flags: set[str]) -> str:
    if vendor == "AuthenticAMD":
        if fam == 26:
            return "Zen 5"
        if fam == 25:
            return "Zen 4" if (0x10 <= mod <= 0x1F or 0x60 <= mod <= 0x7F or 0xA0 <= mod <= 0xAF) else "Zen 3"
        if fam == 23:
            return "Zen / Zen 2"
    if vendor == "GenuineIntel" and "amx_bf16" in flags:
        return "Sapphire Rapids or later (AMX)"
    return "unknown"


def isa_line(i: dict) -> str:
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in i["flags"].items())
    return (
        f"{i['model_name']} ({i['vendor']} family {i['family']} model {i['model']}, {i['microarchitecture']}): {flags}"
    )


def run_header(i: dict) -> dict:
    """What every run's JSON starts with: the machine's ISA (`isa()`), the command, the time, torch."""
    return {
        "isa": i,
        "isa_line": isa_line(i),
        "command": command_line(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
    }


def slug_of(i: dict) -> str:
    """A file-name-safe tag: "Sapphire Rapids or later (AMX)" -> sapphire-rapids-or-later-amx."""
    words = "".join(c if c.isalnum() else " " for c in i["microarchitecture"].lower()).split()
    return "-".join(words)


def default_title(i: dict) -> str:
    f = i["flags"]
    bits = [
        "AVX512-BF16" if f["avx512_bf16"] else "no AVX512-BF16",
        "VNNI" if f["avx512_vnni"] else "no VNNI",
        "AMX" if f["amx_bf16"] else "no AMX",
    ]
    return f"{i['model_name']} {i['microarchitecture']} ({', '.join(bits)})"


def native_precision(i: dict) -> str:
    return "bfloat16" if i["flags"]["avx512_bf16"] or i["flags"]["amx_bf16"] else "float32"


# --- FLOPs ---------------------------------------------------------------------------------------
def useful_flops(cfg: BertConfig, lengths: list[int]) -> float:
    """2 x multiply-adds of the forwards over the real tokens only (no padding), pooler and head included."""
    H, inner, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    total = 0.0
    for n in lengths:
        total += L * (2 * n * (4 * H * H + 2 * H * inner) + 4 * n * n * H) + 2 * H * H + 2 * H * cfg.num_labels
    return total


# --- systems: each runs a whole pass and returns the (n, levels) logits in batch order ------------
Pass = Callable[[], torch.Tensor]


def qtrel_batches(m: RelevanceModel, lists: list[tuple[list, list]], batches: list[Batch], padded: bool) -> Pass:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            if padded:
                return torch.cat([m.module(b.ids, b.seg, b.mask, cls_only=True)[0].float() for b in batches])
            return torch.cat([m.logits(ids, seg) for ids, seg in lists])

    return run


def qtrel_workers(m: RelevanceModel, lists: list[tuple[list, list]]) -> Pass:
    """The batches of 32 shared out over qtrel's forward workers (model.parallel), as encoded_logits does."""

    def run() -> torch.Tensor:
        return torch.cat(run_batches(m.forward_workers(), lambda b: m.logits(*b), lists))

    return run


def qtrel_own(m: RelevanceModel, enc, order: list[int]) -> Pass:
    def run() -> torch.Tensor:
        return m.encoded_logits(enc, MAX_BATCH_TOKENS)[order]

    return run


def hf_pass(hf, batches: list[Batch]) -> Pass:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat(
                [hf(input_ids=b.ids, attention_mask=b.mask, token_type_ids=b.seg).logits.float() for b in batches]
            )

    return run


def ort_pass(path: Path, threads: int, batches: list[Batch]) -> Pass:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feeds = [{k: v for k, v in b.feeds().items() if k in names} for b in batches]

    def run() -> torch.Tensor:
        return torch.from_numpy(np.concatenate([sess.run(None, f)[0] for f in feeds]))

    return run


def openvino_passes(onnx_path: Path, threads: int, precision: str, batches: list[Batch]) -> tuple[Pass, Pass, dict]:
    import openvino as ov

    core = ov.Core()
    ir = core.read_model(str(onnx_path))
    hint = {"bfloat16": "bf16", "float32": "f32"}[precision]
    lat = core.compile_model(
        ir, "CPU", {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads}
    )
    thr = core.compile_model(
        ir,
        "CPU",
        {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_PRECISION_HINT": hint, "INFERENCE_NUM_THREADS": threads},
    )
    feeds = [b.feeds() for b in batches]
    lat_req = lat.create_infer_request()
    n_req = thr.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
    queue = ov.AsyncInferQueue(thr, n_req)
    outs: list[np.ndarray | None] = [None] * len(batches)

    def done(req, i):
        outs[i] = req.get_output_tensor(0).data.copy()

    queue.set_callback(done)

    def latency() -> torch.Tensor:
        return torch.from_numpy(np.concatenate([lat_req.infer(f)[0].copy() for f in feeds]))

    def throughput() -> torch.Tensor:
        for i, f in enumerate(feeds):
            queue.start_async(f, userdata=i)
        queue.wait_all()
        return torch.from_numpy(np.concatenate(outs))

    info = {
        "version": ov.__version__,
        "latency": {
            k: str(lat.get_property(k)) for k in ("NUM_STREAMS", "INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT")
        },
        "throughput": {
            k: str(thr.get_property(k)) for k in ("NUM_STREAMS", "INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT")
        }
        | {"infer_requests": n_req},
    }
    return latency, throughput, info


# --- the matmul probe ----------------------------------------------------------------------------
def probe_pass(cfg: BertConfig, dtype: torch.dtype, seconds: float) -> Callable[[], float]:
    """GFLOP/s of a bare FFN (up and down linear, no activation) on PROBE_ROWS tokens: the best of
    torch's F.linear and a pre-packed oneDNN linear, median over the iterations of a short window."""
    H, inner = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, H, generator=g).to(dtype)
    w1, w2 = (
        (torch.randn(inner, H, generator=g) * 0.05).to(dtype),
        (torch.randn(H, inner, generator=g) * 0.05).to(dtype),
    )
    b1, b2 = torch.zeros(inner, dtype=dtype), torch.zeros(H, dtype=dtype)
    up, down = OneDNNLinear(w1, b1), OneDNNLinear(w2, b2)
    kinds = {"F.linear": lambda: F.linear(F.linear(x, w1, b1), w2, b2), "oneDNN": lambda: down(up(x))}
    flops = 2 * 2 * PROBE_ROWS * H * inner

    def run() -> float:
        best = 0.0
        with torch.inference_mode():
            for fn in kinds.values():
                fn()
                times, t_end = [], time.perf_counter() + seconds / len(kinds)
                while time.perf_counter() < t_end or len(times) < 5:
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                best = max(best, flops / statistics.median(times) / 1e9)
        return best

    return run


# --- measurement ---------------------------------------------------------------------------------
class Pause:
    """SIGSTOP processes for the timed part of one repeat and SIGCONT it after, whatever happens; never
    for more than `limit` seconds at a stretch (`tick` between systems lets it run for a second)."""

    def __init__(self, pids: list[int] | None, limit: float = 600.0, match: str | None = None):
        self.given, self.match, self.limit, self.since = pids or [], match, limit, 0.0
        self.pids: list[int] = []

    def _resolve(self) -> None:  # `match`: whatever runs under that command line now (pgrep -f)
        found = []
        if self.match:
            out = subprocess.run(["pgrep", "-f", self.match], capture_output=True, text=True).stdout
            found = [int(x) for x in out.split() if int(x) != os.getpid()]
        self.pids = self.given + found

    def _send(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def __enter__(self):
        self._resolve()
        self._send(signal.SIGSTOP)
        self.since = time.monotonic()
        return self

    def tick(self) -> None:
        if self.pids and time.monotonic() - self.since > self.limit:
            self._send(signal.SIGCONT)
            time.sleep(1.0)
            self._resolve()
            self._send(signal.SIGSTOP)
            self.since = time.monotonic()

    def __exit__(self, *exc):
        self._send(signal.SIGCONT)


def measure(systems: dict[str, Pass], probes: dict[str, Callable[[], float]], repeats: int, pause: Pause):
    """Seconds (wall and this process's CPU) per pass of each system, probes beside them, interleaved,
    after one warm-up pass per system (every shape once) that also gives the logits."""
    runs = {}
    for name, fn in systems.items():
        t0 = time.perf_counter()
        runs[name] = {"logits": fn(), "seconds": [], "cpu_seconds": [], "warmup_s": time.perf_counter() - t0}
        print(f"  warm-up {name}: {runs[name]['warmup_s']:.1f}s", flush=True)
    probe_runs: dict[str, list[float]] = {p: [] for p in probes}
    load: list[dict] = []
    names = list(systems) + list(probes)
    for r in range(repeats):
        t_rep = time.perf_counter()
        with pause as pz:
            for name in names[r % len(names) :] + names[: r % len(names)]:
                pz.tick()
                if name in probes:
                    probe_runs[name].append(probes[name]())
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                systems[name]()
                runs[name]["seconds"].append(time.perf_counter() - t0)
                runs[name]["cpu_seconds"].append(time.process_time() - c0)
        load.append({"loadavg_1min_after": os.getloadavg()[0], "repeat_s": round(time.perf_counter() - t_rep, 1)})
        print(
            f"  repeat {r + 1}/{repeats} ({load[-1]['repeat_s']}s, load {load[-1]['loadavg_1min_after']:.1f}): "
            + ", ".join(f"{n} {runs[n]['seconds'][-1]:.2f}s" for n in systems)
            + "; probes "
            + ", ".join(f"{p} {v[-1]:.0f} GFLOP/s" for p, v in probe_runs.items()),
            flush=True,
        )
    return runs, probe_runs, load


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": [round(x, 2) for x in xs]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("model/default"))
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
    p.add_argument("--tag", default="", help="suffix of the JSON name and the docs section (e.g. -2threads)")
    p.add_argument("--render", type=Path, help="only re-render the docs section from this JSON")
    p.add_argument("--quick", action="store_true", help="smoke run: 256 pairs, 1 repeat, under /tmp/qtrel-bench-quick")
    a = p.parse_args()
    if a.quick:
        a.pairs, a.repeats, a.probe_seconds = min(a.pairs, 256), 1, 0.3
    if a.render:
        report = json.loads(a.render.read_text())
        slug = slug_of(report["isa"])
        update_section(DOCS, f"anchors:{slug}{a.tag}", render(report, a.title or default_title(report["isa"])))
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
    kind = {"onednn-packed": "oneDNN", "fused": "fused, MKL"}  # model.engines.kernels' choice for this CPU and dtype

    def kernels(m: RelevanceModel) -> str:
        return kind.get(m.cpu_kernels, m.cpu_kernels)

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
    # the attention kernel this CPU does not ship, in the same run (model.engines.kernels.choose_attention): where the
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
    versions = {"torch": torch.__version__}
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
    }
    text = render(report, a.title or default_title(cpu))
    print("\n" + text)
    slug = slug_of(cpu) + a.tag
    md, js = publish("anchors", slug, report, text, a.quick)
    print(f"\nwrote {js} and the anchors:{slug} section of {md}")
    return 0


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
        f"Measured {m['date']} with `bench/anchors.py` ({r['pairs']} held-out Home Depot dev pairs, {r['batches']} "
        f"length-sorted batches of 32, tokenisation not timed, systems and probes interleaved within each repeat, "
        f"order rotated, {r['repeats']} repeats: median (range)). {r['threads']} thread(s) everywhere (torch, "
        "ONNX Runtime intra-op, OpenVINO INFERENCE_NUM_THREADS).",
        "",
        f"- ISA: {r['isa_line']}",
        f"- command: `{r['command']}`",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
        "- matmul probe (bare FFN linears 384→1536→384 on 1024 tokens, best of F.linear and pre-packed oneDNN), "
        "GFLOP/s: "
        + "; ".join(
            f"{k.removeprefix('probe ')} {v['median']:.0f} ({v['min']:.0f}–{v['max']:.0f})" for k, v in pr.items()
        ),
        f"- useful FLOPs count real tokens only: {r['useful_gflop_per_pass']:.0f} GFLOP per pass of "
        f"{r['tokens']} tokens.",
        f"- load: {load_note(r)}; 1-minute load average after each repeat: "
        + ", ".join(f"{x['loadavg_1min_after']:.1f}" for x in r["load"])
        + ". Pairs per CPU-second (this process's user+sys time, OpenMP spin included) is beside the wall-clock "
        "rate.",
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
        lines.append(f"- {name}: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
