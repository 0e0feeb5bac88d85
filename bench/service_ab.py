"""Two checkpoints served by `qtrel serve`, compared under the same load in one run.

Both servers start once (default layout, loopback) and stay up; short windows of scenario (a) (64
one-pair clients) and (b) (8 clients x 1 query x 50 titles) alternate between them, round after round,
so that drift in this shared machine's speed hits both alike. Only one server is driven at a time (the
other is idle). Reports the median pairs/s and p50 of each, and the speed-up of B over A as the median of the per-round
ratios (each round's A and B windows are minutes apart at most). Used for the
pruned default model (docs/heads.md):

  python bench/service_ab.py --a model/default --b runs/pruned60-ft/best --section prune-service
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from harness.clients import scenario
from harness.data import one_pair_bodies, query_bodies, read_dev, tiny_checkpoint
from harness.machine import cpu_kind
from harness.offline import throughput
from harness.publish import ROOT, command_line, machine, machine_lines, output_paths, update_block, write_json
from harness.server import Server, free_port, qtrel_command

HEADS_MD = ROOT / "docs" / "heads.md"


def offline_speedup(a: Path, b: Path, dtype: str, pairs: list, repeats: int) -> dict:
    """Both checkpoints in this process (all cores as torch threads), predict over the same dev pairs,
    A and B alternating within each repeat; median pairs/s of each."""
    import torch

    from model.device import resolve_dtype
    from model.relevance import RelevanceModel

    dtype = resolve_dtype(dtype, torch.device("cpu"))
    models = {"A": RelevanceModel.load(a, dtype=dtype), "B": RelevanceModel.load(b, dtype=dtype)}
    out = throughput(models, pairs, repeats, max_batch_tokens=8192, warmup_pairs=len(pairs))
    print(f"offline ({dtype}): A {out['A']:.0f} pairs/s, B {out['B']:.0f} pairs/s, B / A {out['B'] / out['A']:.2f}")
    return {"dtype": dtype, **out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, help="reference checkpoint (required but with --quick)")
    ap.add_argument("--b", type=Path, help="checkpoint compared with it (required but with --quick)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0, help="measured seconds per window")
    ap.add_argument("--warmup", type=float, default=1.5, help="seconds per window before measuring")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--section", help="write the table into this marker section of docs/heads.md")
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint against itself, 1 s windows")
    a = ap.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="qtrel-ab-model-")
    if a.quick:
        a.rounds, a.seconds, a.warmup = 1, 1.0, 0.3
        a.a = a.a or tiny_checkpoint(Path(scratch.name) / "tiny")
        a.b = a.b or a.a
    if a.a is None or a.b is None:
        ap.error("--a and --b are required")
    rows = read_dev()
    n_pairs, n_queries = (64, 4) if a.quick else (4000, 80)
    loads = {
        "(a) 64 clients x 1 pair": (one_pair_bodies(rows, n_pairs)[0], 64),
        "(b) 8 clients x 1 query, 50 titles": (query_bodies(rows, n_queries, 50)[0], 8),
    }
    models = {"A": a.a, "B": a.b}
    dev_pairs = [(r["query"], r["title"]) for r in rows[: 200 if a.quick else 2000]]
    offline = offline_speedup(a.a, a.b, a.dtype, dev_pairs, 1 if a.quick else 5)
    results: dict[str, dict[str, list[tuple[float, float]]]] = {m: {k: [] for k in loads} for m in models}
    with tempfile.TemporaryDirectory(prefix="qtrel-ab-") as tmp, ExitStack() as stack:
        urls = {}
        for name, path in models.items():
            url = f"http://127.0.0.1:{free_port()}"
            cmd = qtrel_command(path, int(url.rsplit(":", 1)[1]), a.dtype)
            stack.enter_context(Server(cmd, url, "/health/ready", Path(tmp) / f"{name}.log", 300))
            urls[name] = url

        async def drive():
            for r in range(a.rounds):
                order = list(models) if r % 2 == 0 else list(models)[::-1]
                for name in order:
                    for load, (bodies, clients) in loads.items():
                        o = await scenario(f"{name} {load}", urls[name], bodies, a, None, clients=clients)
                        results[name][load].append((o["pairs_per_s"], o["p50_ms"]))

        asyncio.run(drive())

    lines = [
        "| load | A pairs/s | B pairs/s | B / A (median of rounds) | A p50 ms | B p50 ms | B / A per round |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    summary = {}
    for load in loads:
        ra, rb = results["A"][load], results["B"][load]
        pa, pb = statistics.median(x[0] for x in ra), statistics.median(x[0] for x in rb)
        la, lb = statistics.median(x[1] for x in ra), statistics.median(x[1] for x in rb)
        per_round = [y[0] / x[0] for x, y in zip(ra, rb)]
        speedup = statistics.median(per_round)  # paired by round: drift of the machine cancels
        summary[load] = {"a": pa, "b": pb, "speedup": speedup, "per_round": per_round}
        lines.append(
            f"| {load} | {pa:.0f} | {pb:.0f} | {speedup:.2f}× | {la:.0f} | {lb:.0f} | "
            f"{', '.join(f'{x:.2f}' for x in per_round)} |"
        )
    lines.append(
        f"| offline: predict on {len(dev_pairs)} dev pairs, one process, {offline['dtype']} | "
        f"{offline['A']:.0f} | {offline['B']:.0f} | {offline['B'] / offline['A']:.2f}× | | | |"
    )
    m = machine()
    body = "\n".join(
        [
            *machine_lines(m, command_line()),
            f"- A: `{a.a}`; B: `{a.b}`; `qtrel serve` with its default layout, dtype {a.dtype}; "
            f"{a.rounds} rounds of {a.seconds:g} s windows per load, A and B alternating",
            "",
            *lines,
        ]
    )
    print("\n" + body)
    if a.section and not a.quick:
        _, raw = output_paths(f"service_ab_{a.section}", cpu_kind(), False)
        write_json(
            raw,
            {
                "machine": m,
                "command": command_line(),
                "a": str(a.a),
                "b": str(a.b),
                "results": results,
                "summary": summary,
                "offline": offline,
            },
        )
        update_block(HEADS_MD, a.section, body)
        print(f"wrote {raw} and the {a.section} section of {HEADS_MD}")
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
