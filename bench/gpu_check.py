"""qtrel's CUDA path on a real GPU, in one short run (issue 24): correctness against the CPU's float32
forward, offline throughput beside transformers, and `qtrel serve` under load. Results go to --out as
gpu_check.json and gpu_check.md, and on a GPU into the GPU kind's table of docs/benchmarks.md.

  python bench/gpu_check.py --out DIR      # on the GPU machine (bench/gpu_check.sh)
  python bench/gpu_check.py --quick        # dry run without a GPU: every step on the CPU, a tiny checkpoint

- correctness: the CPU's plain float32 forward is the reference. On the device: float32 logits within 1e-4,
  float16 and bfloat16 levels on dev pairs (target >= 99.5% the same), a head mask and a pruned module.
- offline: the built-in model and a BERT-base-sized model with random weights, float16 and bfloat16, at
  batch budgets of 8k-64k padded tokens: qtrel's `encoded_logits` against transformers (sdpa, same dtype,
  the same padded batches), pairs/s and useful TFLOP/s (real tokens only) against the GPU's measured
  bfloat16 matmul rate in the same run.
- serving: `qtrel serve` on the device (cache off) with 64 one-pair aiohttp clients and 8 clients of one
  query x 50 titles; pairs/s, p50/p99, and the GPU's busy share sampled by NVML.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import csv
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from harness.data import DEFAULT_MODEL, base_checkpoint, tiny_checkpoint, useful_flops
from harness.machine import gpu_kind
from harness.publish import DEV, publish, quick_dir

from model.checkpoint import load_module
from model.packing import pad_batch
from model.relevance import RelevanceModel

ROOT = Path(__file__).resolve().parents[1]

BUDGETS = (8192, 16384, 32768, 65536)


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def environment(dev: str) -> dict:
    out: dict[str, Any] = {"torch": torch.__version__, "device": dev, "python": sys.version.split()[0]}
    if dev.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        out |= {"gpu": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1)}
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        pass
    return out


def matmul_rate(dev: str, dtype: torch.dtype, n: int) -> float:
    """TFLOP/s of an n x n x n product in `dtype`: the ceiling the offline rows are read against."""
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(dev)
    reps = 10 if dev.startswith("cuda") else 2
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(dev)
    return 2 * n**3 * reps / (time.perf_counter() - t) / 1e12


# --- correctness -----------------------------------------------------------------------------------
def correctness(model: Path, dev: str, pairs: list[tuple[str, str]], dtypes: list[str]) -> dict:
    ref = RelevanceModel.load(model, device="cpu", dtype="float32", onednn=False, unpadded=False)
    enc = ref.encode(pairs)
    with torch.inference_mode():
        ref_logits = ref.encoded_logits(enc)
    ref_level = ref.score(ref_logits).level
    out: dict = {"pairs": len(pairs), "dtypes": {}}
    for dt in dtypes:
        m = RelevanceModel.load(model, device=dev, dtype=dt)
        with torch.inference_mode():
            lg = m.encoded_logits(enc)
        s = m.score(lg)
        out["dtypes"][dt] = {
            "max_abs_logit_diff": float((lg - ref_logits).abs().max()),
            "same_level": float((s.level == ref_level).float().mean()),
        }
        print(f"  correctness {dt}: {out['dtypes'][dt]}", flush=True)
    # a head mask and a pruned module, float32 on the device against the CPU
    few = pairs[:512]
    cfg = ref.cfg
    mask = torch.ones(cfg.num_hidden_layers, cfg.num_attention_heads)
    mask[0, :4] = 0
    mask[3, 7] = 0
    mask[cfg.num_hidden_layers - 1, 1:] = 0
    m32 = RelevanceModel.load(model, device=dev, dtype="float32")
    e = ref.encode(few)
    with torch.inference_mode():
        a, b = ref.encoded_logits(e, head_mask=mask), m32.encoded_logits(e, head_mask=mask)
    out["head_mask_max_abs_diff"] = float((a - b).abs().max())
    out["heads_silenced"] = int((mask == 0).sum())
    out["head_mask_changes_logits"] = float((a - ref.encoded_logits(e)).abs().max())
    from model.train.heads import prune_heads

    remove = [(0, 0), (0, 5), (1, 3), (2, 11), (4, 6), (5, 2), (5, 9)]
    module = prune_heads(load_module(model), remove)
    cpu_m = RelevanceModel(copy.deepcopy(module), ref.tokenizer, device="cpu", dtype="float32", onednn=False)
    dev_m = RelevanceModel(copy.deepcopy(module), ref.tokenizer, device=dev, dtype="float32")
    with torch.inference_mode():
        out["pruned_max_abs_diff"] = float((cpu_m.encoded_logits(e) - dev_m.encoded_logits(e)).abs().max())
    out["pruned_heads"] = len(remove)
    print(
        f"  head mask diff {out['head_mask_max_abs_diff']:.2e} (mask moves logits by "
        f"{out['head_mask_changes_logits']:.3f}); pruned diff {out['pruned_max_abs_diff']:.2e}",
        flush=True,
    )
    return out


# --- offline throughput ----------------------------------------------------------------------------
def padded_batches(m: RelevanceModel, enc, budget: int) -> list[tuple[torch.Tensor, ...]]:
    """The very batches `encoded_logits` forms (`RelevanceModel.batches_of`), padded."""
    return [
        pad_batch([enc.input_ids[i] for i in b], [enc.token_type_ids[i] for i in b], m.tokenizer.pad_id)
        for b in m.batches_of(enc.lengths, budget)
    ]


def timed(fn, dev: str, reps: int) -> float:
    fn()
    sync(dev)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(dev)
        best = min(best, time.perf_counter() - t)
    return best


def budget_row(m: RelevanceModel, hf, enc, budget: int, dev: str, reps: int) -> tuple[float, float, float, int]:
    """Seconds per pass over the same pairs at one budget: qtrel's `encoded_logits` (padding, copies and
    results included), qtrel's module alone and transformers on the same padded batches already on the
    device; and the batch count."""
    batches = [tuple(x.to(dev) for x in b) for b in padded_batches(m, enc, budget)]

    def hf_pass():
        return [hf(input_ids=i, token_type_ids=s, attention_mask=k).logits for i, s, k in batches]

    def module_pass():
        return [m.module(i, s, k, cls_only=True)[0] for i, s, k in batches]

    with torch.inference_mode():
        t_q = timed(lambda: m.encoded_logits(enc, budget), dev, reps)
        return t_q, timed(module_pass, dev, reps), timed(hf_pass, dev, reps), len(batches)


def offline(label: str, path: Path, dev: str, pairs, dtypes: list[str], reps: int, budgets, peak: float) -> list:
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    rows = []
    for dt in dtypes:
        m = RelevanceModel.load(path, device=dev, dtype=dt)
        enc = m.encode(pairs)
        flops = useful_flops(m.cfg, enc.lengths)
        hf: Any = BertForSequenceClassification.from_pretrained(str(path), attn_implementation="sdpa")
        hf = hf.to(device=dev, dtype=getattr(torch, dt)).eval()
        for budget in budgets:
            t_q, t_m, t_h, nb = budget_row(m, hf, enc, budget, dev, reps)
            row = {
                "model": label,
                "dtype": dt,
                "budget": budget,
                "batches": nb,
                "qtrel_pairs_s": len(pairs) / t_q,
                "module_pairs_s": len(pairs) / t_m,
                "transformers_pairs_s": len(pairs) / t_h,
                "qtrel_tflops": flops / t_q / 1e12,
                "transformers_tflops": flops / t_h / 1e12,
            }
            row["vs_transformers"] = row["qtrel_pairs_s"] / row["transformers_pairs_s"]
            row["share_of_matmul"] = row["qtrel_tflops"] / peak
            rows.append(row)
            print(
                f"  {label} {dt} {budget}: qtrel {row['qtrel_pairs_s']:.0f} pairs/s ({row['qtrel_tflops']:.1f} "
                f"TFLOP/s, {row['share_of_matmul']:.1%} of the matmul; module alone {row['module_pairs_s']:.0f}), "
                "transformers "
                f"{row['transformers_pairs_s']:.0f} ({row['vs_transformers']:.2f}x)",
                flush=True,
            )
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


# --- serving -----------------------------------------------------------------------------------------
class GpuBusy:
    """The GPU's busy share while the block runs, sampled by NVML every 100 ms on a thread (None without NVML)."""

    def __enter__(self) -> GpuBusy:
        self.samples: list[int] = []
        self.stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self.thread = None
            return self

        def sample() -> None:
            while not self.stop.wait(0.1):
                self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    @property
    def share(self) -> float | None:
        return statistics.mean(self.samples) / 100 if self.samples else None


def serving(model: Path, dev: str, rows: list[dict], seconds: float, warmup: float, log: Path) -> dict:
    """`qtrel serve` on `dev` under bench/load.py's closed-loop scenarios (its server, bodies and client)."""
    import load

    port = load.free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--device", dev]
    cmd += ["--port", str(port), "--host", "127.0.0.1", "--cache-mb", "0"]
    url = f"http://127.0.0.1:{port}"
    env = os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out: dict = {"command": " ".join(cmd[1:])}
    a = SimpleNamespace(warmup=warmup, seconds=seconds)
    try:
        with load.Server(cmd, url, "/health/ready", log, 240, env=env) as srv:
            with urllib.request.urlopen(url + "/info", timeout=5) as r:
                out["info"] = json.loads(r.read())
            loads = {
                "one_pair_64": (load.one_pair_bodies(rows, 4000)[0], 64),
                "query_50_8": (load.query_bodies(rows, 80, 50)[0], 8),
            }
            for key, (bodies, clients) in loads.items():
                with GpuBusy() as busy:
                    out[key] = asyncio.run(load.scenario(key, url, bodies, a, srv.proc.pid, clients=clients))
                out[key]["gpu_busy"] = busy.share
    except SystemExit as e:  # not ready: the report says why, the offline figures still stand
        out["error"] = str(e)
    return out


# --- report -----------------------------------------------------------------------------------------
def render(r: dict) -> str:
    e = r["environment"]
    lines = [
        f"### qtrel on a GPU: {e.get('gpu', e['device'])} (`bench/gpu_check.py`, {r['date']})",
        "",
        f"- environment: torch {e['torch']}, transformers {e.get('transformers', '-')}, Python {e['python']}, "
        f"device {e['device']}" + (f", compute capability {e['capability']}" if "capability" in e else ""),
        f"- command: `{r['command']}`",
        f"- bfloat16 matmul ({r['matmul_n']}³), measured in this run: {r['matmul_tflops']:.0f} TFLOP/s",
        "",
        f"**Correctness** ({r['correctness']['pairs']} dev pairs; reference: the CPU's plain float32 forward)",
        "",
        "| precision on the device | max abs logit diff | same level |",
        "|---|---:|---:|",
    ]
    for dt, v in r["correctness"]["dtypes"].items():
        lines.append(f"| {dt} | {v['max_abs_logit_diff']:.2e} | {v['same_level']:.2%} |")
    c = r["correctness"]
    lines += [
        "",
        f"- head mask ({c.get('heads_silenced', 'some')} heads silenced), float32, 512 pairs: max abs diff "
        f"{c['head_mask_max_abs_diff']:.2e} "
        f"(the mask itself moves logits by up to {c['head_mask_changes_logits']:.3f})",
        f"- pruned module ({c['pruned_heads']} heads removed), float32: max abs diff {c['pruned_max_abs_diff']:.2e}",
        "",
        f"**Offline** ({r['offline_pairs']} dev pairs, length-sorted batches of at most the budget's padded tokens, "
        "tokenisation not timed, best of the repeats; useful FLOPs count real tokens only)",
        "",
        "| model | precision | budget (tokens) | qtrel pairs/s | qtrel module alone | transformers pairs/s "
        "| × transformers | qtrel TFLOP/s | share of the matmul |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in r["offline"]:
        lines.append(
            f"| {o['model']} | {o['dtype']} | {o['budget']:,} | {o['qtrel_pairs_s']:,.0f} | "
            f"{o['module_pairs_s']:,.0f} | "
            f"{o['transformers_pairs_s']:,.0f} | {o['vs_transformers']:.2f} | {o['qtrel_tflops']:.1f} | "
            f"{o['share_of_matmul']:.1%} |"
        )
    s = r.get("serving")
    if s:
        lines += ["", f"**Serving**: `{s.get('command', '')}`", ""]
        if "error" in s:
            lines.append(f"- failed: {s['error']}")
        else:
            lines += [
                "| clients | pairs/s | p50 ms | p99 ms | errors | server cores | GPU busy |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for k, name in (("one_pair_64", "64 × 1 pair"), ("query_50_8", "8 × 1 query, 50 titles")):
                v = s[k]
                busy = "—" if v["gpu_busy"] is None else f"{v['gpu_busy']:.0%}"
                lines.append(
                    f"| {name} | {v['pairs_per_s']:,.0f} | {v['p50_ms']:.0f} | {v['p99_ms']:.0f} | "
                    f"{sum(v['errors'].values())} | {v['server_cores']:.2f} | {busy} |"
                )
            info = s.get("info", {})
            lines += ["", f"- `/info`: {json.dumps(info.get('model', info))[:400]}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="folder of the run's files (default: the scratch folder)")
    p.add_argument("--device", help="default: cuda where torch sees a GPU, else cpu (a dry run)")
    p.add_argument("--model", type=Path, help="checkpoint (default: model/default; --quick: a tiny random one)")
    p.add_argument("--dev", type=Path, default=DEV)
    p.add_argument("--quick", action="store_true", help="dry run: few pairs, one budget, a 1-layer base model")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per serving scenario")
    p.add_argument("--no-serve", action="store_true")
    a = p.parse_args()
    a.out = a.out or quick_dir() / "gpu_check"
    a.out.mkdir(parents=True, exist_ok=True)
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    scratch = tempfile.TemporaryDirectory(prefix="qtrel-gpu-model-")
    if a.quick and a.model is None:
        # MiniLM's 6 layers and 12 heads, which the head-mask and pruning checks address, at hidden 48
        shape = dict(num_hidden_layers=6, num_attention_heads=12, hidden_size=48, intermediate_size=96)
        a.model = tiny_checkpoint(Path(scratch.name) / "tiny", **shape)
    a.model = a.model or DEFAULT_MODEL
    gpu = dev.startswith("cuda")
    n = 256 if a.quick else 7206
    with a.dev.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    pairs = [(row["query"], row["title"]) for row in rows[:n]]
    dtypes = ["float32", "float16", "bfloat16"] if gpu else ["float32", "bfloat16"]
    low = ["float16", "bfloat16"] if gpu else ["bfloat16"]
    r: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": "python bench/gpu_check.py " + " ".join(sys.argv[1:]),
        "environment": environment(dev),
    }
    print(f"environment: {r['environment']}", flush=True)
    r["matmul_n"] = 8192 if gpu else 512
    r["matmul_tflops"] = matmul_rate(dev, torch.bfloat16, r["matmul_n"])
    print(f"bf16 matmul: {r['matmul_tflops']:.1f} TFLOP/s", flush=True)
    t = time.time()
    r["correctness"] = correctness(a.model, dev, pairs, dtypes)
    r["correctness"]["seconds"] = time.time() - t
    budgets = BUDGETS[:1] if a.quick else BUDGETS
    reps = 1 if a.quick else 3
    off_pairs = pairs if gpu else pairs[:64]
    r["offline_pairs"] = len(off_pairs)
    with tempfile.TemporaryDirectory(prefix="qtrel-gpu-") as tmp:
        base = base_checkpoint(Path(tmp) / "base", 1 if a.quick else 12, tok_dir=a.model)
        r["offline"] = offline("built-in (MiniLM-L6)", a.model, dev, off_pairs, low, reps, budgets, r["matmul_tflops"])
        r["offline"] += offline("BERT-base-sized, random", base, dev, off_pairs, low, reps, budgets, r["matmul_tflops"])
    if not a.no_serve:
        r["serving"] = serving(
            a.model, dev, rows, 1.0 if a.quick else a.seconds, 0.5 if a.quick else 3.0, a.out / "serve.log"
        )
    (a.out / "gpu_check.json").write_text(json.dumps(r, indent=1) + "\n")
    (a.out / "gpu_check.md").write_text(render(r))
    print(render(r))
    if gpu:  # a dry run on the CPU publishes nothing
        publish("gpu_check", r, render(r), a.quick, kind=gpu_kind(torch.cuda.get_device_name()))
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
