"""What a served pair costs the model processes against an offline pair (issue 20: "served batches of 8-24
pairs within 1.15x of the per-pair cost of offline batches of 32").

Starts `qtrel serve` on the default layout with the score cache off (every pair forwarded), drives it with
64 closed-loop one-pair clients (aiohttp) over distinct dev pairs, and over a measured window takes the
CPU time of the model processes (every process below the HTTP one) and the pairs they forwarded (the
server's `qtrel_batch_pairs` counter). Then, in this process on one thread (a model process's), the CPU
time per pair of the same pairs forwarded offline in length-sorted batches of 32. The HTTP process's
own CPU is reported beside, not counted: the target is the model path's.

    python bench/served_cost.py [--seconds 20] [--pairs 7206]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch
from harness.clients import Http, closed_loop
from harness.data import one_pair_bodies, read_dev, tiny_checkpoint
from harness.machine import default_title, isa
from harness.publish import command_line, machine, machine_lines, publish
from harness.server import Server, free_port, metrics_of, own_cpu_seconds, qtrel_command, tree

from model.builtin import builtin_dir
from model.relevance import RelevanceModel


def split_cpu(root: int) -> tuple[float, float]:
    """(the HTTP process's CPU seconds, the CPU seconds of every live process below it)."""
    return own_cpu_seconds(root), sum(own_cpu_seconds(pid) for pid, _ in tree(root)[1:])


async def served(base: str, root: int, bodies: list, clients: int, warmup: float, seconds: float) -> dict:
    async with Http(clients) as http, Http(1) as control:
        end = time.perf_counter() + warmup + seconds
        task = asyncio.ensure_future(closed_loop(http, base + "/score", bodies, clients, end))
        await asyncio.sleep(warmup)
        m0, c0, t0 = metrics_of(await control.get_text(base + "/metrics")), split_cpu(root), time.perf_counter()
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        m1, c1, wall = metrics_of(await control.get_text(base + "/metrics")), split_cpu(root), time.perf_counter() - t0
        await task
    pairs = m1["qtrel_batch_pairs_sum"] - m0["qtrel_batch_pairs_sum"]
    batches = m1["qtrel_batch_pairs_count"] - m0["qtrel_batch_pairs_count"]
    http_s, model_s = c1[0] - c0[0], c1[1] - c0[1]
    return {
        "pairs": pairs,
        "pairs_per_s": pairs / wall,
        "mean_batch_pairs": pairs / batches if batches else float("nan"),
        "model_cpu_ms_per_pair": 1e3 * model_s / pairs,
        "http_cpu_ms_per_pair": 1e3 * http_s / pairs,
        "model_cores": model_s / wall,
        "http_cores": http_s / wall,
    }


def offline(model_dir: str, pairs: list[tuple[str, str]], rounds: int) -> float:
    """CPU ms per pair on one thread, length-sorted batches of 32 (the best of `rounds`)."""
    torch.set_num_threads(1)
    m = RelevanceModel.load(model_dir, dtype="auto")
    m.warm_up()
    enc = m.encode(pairs)
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    chunks = [order[i : i + 32] for i in range(0, len(order), 32)]
    lists = [([enc.input_ids[i] for i in c], [enc.token_type_ids[i] for i in c]) for c in chunks]
    best = float("inf")
    for _ in range(rounds):
        c0 = time.process_time()
        for ids, segs in lists:
            m.logits(ids, segs)
        best = min(best, time.process_time() - c0)
    return 1e3 * best / len(pairs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(builtin_dir("default")))
    p.add_argument("--pairs", type=int, default=7206)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--offline-pairs", type=int, default=2000)
    p.add_argument("--offline-rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, 64 pairs, 1 s, scratch")
    a = p.parse_args()
    rows = read_dev()
    with tempfile.TemporaryDirectory() as tmp:
        if a.quick:
            a.pairs, a.offline_pairs, a.offline_rounds, a.warmup, a.seconds = 64, 64, 1, 0.3, 1.0
            a.model = str(tiny_checkpoint(Path(tmp) / "tiny"))
        bodies, _ = one_pair_bodies(rows, a.pairs)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = qtrel_command(Path(a.model), port)
        with Server(cmd, base, "/health/ready", Path(tmp) / "server.log", timeout=300) as server:
            s = asyncio.run(served(base, server.proc.pid, bodies, a.clients, a.warmup, a.seconds))
        pairs = [(r["query"], r["title"]) for r in rows[: a.offline_pairs]]
        off = offline(a.model, pairs, a.offline_rounds)
    report = {"machine": machine(), "command": command_line(), "title": default_title(isa()), "quick": a.quick}
    report |= {"model": a.model, "clients": a.clients, "seconds": a.seconds, "served": s, "offline_pairs": len(pairs)}
    report |= {"offline_cpu_ms_per_pair": off, "served_over_offline": s["model_cpu_ms_per_pair"] / off}
    text = render(report)
    print(text)
    publish("served_cost", report, text, a.quick)
    return 0


def fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def render(r: dict) -> str:
    s = r["served"]
    return "\n".join(
        [
            f"### What a served pair costs: {r['title']} (`bench/served_cost.py`)",
            "",
            f"`qtrel serve` (default layout, score cache off) under {r['clients']} closed-loop one-pair clients for "
            f"{r['seconds']:g} s, against one thread forwarding length-sorted batches of 32 of {r['offline_pairs']} "
            "dev pairs offline; CPU time of the model processes per pair forwarded.",
            "",
            *machine_lines(r["machine"], r["command"]),
            f"- model: `{r['model']}`",
            "",
            "| served pairs/s | mean batch pairs | model CPU ms/pair, served | offline | served ÷ offline "
            "| HTTP CPU ms/pair | model / HTTP cores |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {s['pairs_per_s']:.0f} | {s['mean_batch_pairs']:.1f} | {s['model_cpu_ms_per_pair']:.2f} | "
            f"{r['offline_cpu_ms_per_pair']:.2f} | **{r['served_over_offline']:.2f}×** | "
            f"{s['http_cpu_ms_per_pair']:.2f} | {fmt(s.get('model_cores'))} / {fmt(s.get('http_cores'))} |",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
