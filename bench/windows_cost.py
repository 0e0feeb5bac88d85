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

from live import Server, pct, post_all
from results import DEV, command_line, machine, machine_lines, output_paths, update_section, write_json

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
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.rounds = 8, 1
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
    base = med["truncated (default)"]["docs_per_s"]
    rows = [
        f"| {m} | {v['windows_per_doc']:.2f} | {v['docs_per_s']:.0f} | {v['docs_per_s'] / base:.2f} | "
        f"{v['docs_per_s'] * v['windows_per_doc']:.0f} | {v['p50_ms']:.0f} | {v['p99_ms']:.0f} |"
        for m, v in med.items()
    ]
    report = {"machine": machine(), "command": command_line(), "runs": runs, "median": med}
    text = "\n".join(
        [
            "## Long documents in windows (`bench/windows_cost.py`)",
            "",
            f"One `qtrel serve` (default model and layout, `--cache-mb 0`: every window forwarded), {a.requests} "
            "requests of a Home Depot dev query with 10 documents, each 15 real dev titles joined, sent by "
            f"{a.clients} clients; `/score` truncating (the default) against `max_chunks` 2 and 8 with "
            f"`chunk_overlap` {a.overlap}; interleaved, order rotated per round, median of {a.rounds} rounds.",
            "",
            *machine_lines(report["machine"], report["command"]),
            "",
            "| mode | windows per document | documents/s | x truncated | windows (pairs)/s | p50 ms | p99 ms |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "A document costs about its windows: the pairs/s of the windows stay those of ordinary pairs.",
        ]
    )
    print("\n" + text)
    md, js = output_paths("windows_cost", a.quick)
    write_json(js, report)
    update_section(md, "windows_cost", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
