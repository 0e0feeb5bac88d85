"""What long documents in windows cost: one `qtrel serve` (score cache off, so that every window is
forwarded), requests of a Home Depot dev query with 10 long documents, each the concatenation of 15 real dev
titles (~150-250 word pieces: 2-3 windows of what the query leaves of 128 tokens),
sent by 8 clients, by /score's default truncation and with `max_chunks` 2 and 8; the modes interleaved,
order rotated per round. Documents per second, windows per document, p50/p99.

  python bench/windows_cost.py              # into docs/benchmarks.md and docs/bench/windows_cost.json
  python bench/windows_cost.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import statistics
import tempfile
from pathlib import Path

from harness.data import tiny_checkpoint
from harness.live import Server, pct, post_all
from harness.machine import default_title, isa
from harness.publish import DEV, command_line, machine, machine_lines, publish

MODES = {"truncated (default)": None, "max_chunks 2": 2, "max_chunks 8": 8}


def requests(n: int, seed: int) -> list[tuple[str, list[str]]]:
    with DEV.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    rng = random.Random(seed)
    titles = [r["title"] for r in rows]
    out = []
    for _ in range(n):
        q = rng.choice(rows)["query"]
        out.append((q, [". ".join(rng.sample(titles, 15)) for _ in range(10)]))
    return out


async def replay(url: str, trace, max_chunks: int | None, overlap: int, clients: int) -> dict:
    bodies = []
    for q, docs in trace:
        body: dict = {"query": q, "titles": docs, "return_probs": False}
        if max_chunks:
            body |= {"max_chunks": max_chunks, "chunk_overlap": overlap}
        bodies.append(json.dumps(body).encode())
    got, latencies, wall = await post_all(url + "/score", bodies, clients)
    failed = got.count(None)
    windows = [x.get("window", {}).get("count", 1) for a in got if a is not None for x in a["results"]]
    docs = sum(len(d) for _, d in trace)
    return {"docs_per_s": docs / wall, "windows_per_doc": statistics.mean(windows) if windows else 0,
            "p50_ms": pct(latencies, 0.5), "p99_ms": pct(latencies, 0.99), "failed": failed}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:default")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--overlap", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, 8 requests, 1 round")
    a = ap.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="qtrel-windows-model-")
    if a.quick:
        a.requests, a.rounds = 8, 1
        a.model = str(tiny_checkpoint(Path(scratch.name) / "tiny"))
    trace = requests(a.requests, 0)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    srv = Server(a.model, "--cache-mb", "0")
    try:
        srv.wait_ready()
        asyncio.run(replay(srv.url, trace[:4], 8, a.overlap, 2))  # warm
        names = list(MODES)
        for r in range(a.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                out = asyncio.run(replay(srv.url, trace, MODES[name], a.overlap, a.clients))
                runs[name].append(out)
                print(f"round {r} {name}: {out['docs_per_s']:.0f} docs/s, {out['windows_per_doc']:.2f} windows/doc")
    finally:
        srv.stop()
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in runs.items()}
    report = {"machine": machine(), "command": command_line(), "runs": runs, "median": med, "model": a.model}
    report |= {"requests": a.requests, "clients": a.clients, "overlap": a.overlap, "rounds": a.rounds}
    report["title"] = default_title(isa())
    text = render(report)
    print("\n" + text)
    publish("windows_cost", report, text, a.quick)
    scratch.cleanup()
    return 0


def render(r: dict) -> str:
    med = r["median"]
    base = med["truncated (default)"]["docs_per_s"]
    rows = [
        f"| {m} | {v['windows_per_doc']:.2f} | {v['docs_per_s']:.0f} | {v['docs_per_s'] / base:.2f} | "
        f"{v['docs_per_s'] * v['windows_per_doc']:.0f} | {v['p50_ms']:.0f} | {v['p99_ms']:.0f} |"
        for m, v in med.items()
    ]
    return "\n".join(
        [
            f"### Long documents in windows: {r.get('title') or r['machine']['cpu']} (`bench/windows_cost.py`)",
            "",
            f"One `qtrel serve` (default model and layout, `--cache-mb 0`: every window forwarded), {r['requests']} "
            "requests of a Home Depot dev query with 10 documents, each 15 real dev titles joined, sent by "
            f"{r['clients']} clients; `/score` truncating (the default) against `max_chunks` 2 and 8 with "
            f"`chunk_overlap` {r['overlap']}; interleaved, order rotated per round, median of {r['rounds']} rounds.",
            "",
            *machine_lines(r["machine"], r["command"]),
            "",
            "| mode | windows per document | documents/s | x truncated | windows (pairs)/s | p50 ms | p99 ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "A document costs about its windows: the pairs/s of the windows stay those of ordinary pairs.",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
