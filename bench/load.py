"""Bounded load test of `qtrel serve` on loopback: throughput, latency and padding beside offline speed.

Starts `qtrel serve --model DIR` as a subprocess (or targets --url, loopback only), waits for
/health/ready, and drives it from this process (its own event loop, never the server's):
  (a) 64 concurrent clients, one pair per request;
  (b) 8 clients, one query x 50 titles per request (real dev queries with their titles, then other dev
      titles up to 50, all distinct);
  (c) an open-loop Poisson arrival schedule of one-pair requests at 70% of (a)'s throughput;
  (d) scenario (a) against bench/harness/naive_server.py (transformers, one forward per request);
  (e) scenario (a) against Infinity (`bench/harness/infinity.py`) in the same precision, where it is
      installed: started beside qtrel and interleaved with (a) over --anchor-rounds rounds.
Each scenario runs --warmup then --seconds; only the window after the warm-up counts. The offline
throughput of the same model on the same pairs (RelevanceModel.predict, length-sorted batches, same
threads) is measured in this process before any server starts.

  python bench/load.py                          # full run on the built-in model, into docs/benchmarks.md
  python bench/load.py --quick --model DIR      # smoke run, results under /tmp/qtrel-bench-quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from harness import infinity as infinity_anchor
from harness.clients import Http, scenario
from harness.data import Body, one_pair_bodies, query_bodies, read_dev, tiny_checkpoint
from harness.machine import default_title, isa
from harness.offline import offline_pairs_per_s
from harness.publish import command_line, machine, machine_lines, publish, verdict
from harness.server import Server, free_port, loopback_url, qtrel_command

# vs_infinity and p50_ms: issue 20 (64 one-pair clients >= 4x Infinity in the same run and precision, p50 <= 100 ms)
TARGETS = {"vs_offline": 0.85, "p99_over_p50": 3.0, "vs_naive": 3.0, "vs_infinity": 4.0, "p50_ms": 100.0}
INFINITY_PAIRS_PER_S = 112.0
INFINITY = (
    f"Infinity anchor, measured elsewhere and not re-run here: ~{INFINITY_PAIRS_PER_S:.0f} pairs/s, "
    "p50 ~540 ms, p99 ~850 ms for 64 one-pair clients."
)


# --- workload ------------------------------------------------------------------------------------


# --- HTTP client ---------------------------------------------------------------------------------


# --- servers -------------------------------------------------------------------------------------


# --- report --------------------------------------------------------------------------------------
def fmt(x, spec: str = ".0f") -> str:
    return "—" if x is None else format(x, spec)


def worker_text(w: dict | None) -> str:
    if not w:
        return "its own worker layout"
    return (
        f"{w['replicas']} model process{'es' if w['replicas'] > 1 else ''} x {w['threads']} torch "
        f"thread{'s' if w['threads'] != 1 else ''}"
        if w["mode"] == "process"
        else f"model on a thread, {w['threads'] or 'default'} torch threads"
    )


def inference_text(inference: dict | None) -> str:
    if not inference or not inference.get("inference"):
        return ""
    return f"inference {inference['inference']} ({inference.get('inference_reason')}), "


# notes every run makes (kept in the JSON; docs/benchmarks.md says them once, above the tables)
STANDING_NOTES = ("Pools:", "(c) latency is measured", "(d) answers each request", "Client and server share", "(e) ")


def render(r: dict) -> str:
    lines = [
        f"### Serving under load: {r['title']} (`bench/load.py`)",
        "",
        *machine_lines(r["machine"], r["command"]),
        f"- server: dtype {r.get('dtype', 'auto')}, {worker_text(r.get('server_worker'))}, "
        f"{inference_text(r.get('server_inference'))}client {r['http_client']}, {r['warmup']:g} s warm-up + "
        f"{r['seconds']:g} s per scenario; offline on {r['cores']} cores, pairs/s: "
        + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in lay.items())
            for name, lay in r.get("offline_layouts", {}).items()
        ),
        f"- model: `{r['model']}`; server: {r['server']}",
        "",
        "| scenario | pairs/s | offline pairs/s | % of offline | p50 ms | p95 ms | p99 ms | mean batch pairs "
        "| mean padding | client / server cores | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in r["scenarios"]:
        off = r["offline"].get(s.get("offline_set", ""))
        pct = fmt(100 * s["pairs_per_s"] / off if off else None)
        cores = f"{s['client_cores']:.2f} / {fmt(s['server_cores'], '.2f')}"
        lines.append(
            f"| {s['name']} | {s['pairs_per_s']:.0f} | {fmt(off)} | {pct} | {fmt(s['p50_ms'])} | "
            f"{fmt(s['p95_ms'])} | {fmt(s['p99_ms'])} | {fmt(s.get('mean_batch_pairs'), '.1f')} | "
            f"{fmt(s.get('mean_padding'), '.2f')} | {cores} | {s['errors'] or 0} |"
        )
    lines += [""] + [f"- {verdict(t['pass'])}: {t['target']}" for t in r["targets"]]
    if "infinity_server" in r:
        inf = r["infinity_server"]
        lines.append(f"- (e): {inf['version']}, dtype {inf['dtype']}, {inf['torch_threads']} threads, one process")
    lines += ["", *[f"- {n}" for n in r["notes"] if not n.startswith(STANDING_NOTES)]]
    return "\n".join(lines)


def targets(r: dict) -> list[dict]:
    by: dict[str, dict] = {}
    for s in r["scenarios"]:  # the first of each letter: (a)'s interleaved rounds follow (a) itself
        by.setdefault(s["name"][:3], s)
    out = []
    for key in ("(a)", "(b)"):
        if key in by:
            x = by[key]["pairs_per_s"] / r["offline"][by[key]["offline_set"]]
            out.append((f"{key} >= {TARGETS['vs_offline']:.0%} of offline ({x:.0%})", x >= TARGETS["vs_offline"]))
    if "(c)" in by:
        c = by["(c)"]
        x = c["p99_ms"] / c["p50_ms"]
        out.append(
            (
                f"(c) p99 <= {TARGETS['p99_over_p50']:g}x p50 at {r['load_fraction']:.0%} load ({x:.2f}x)",
                x <= TARGETS["p99_over_p50"],
            )
        )
    anchor = r.get("infinity")
    if "(a)" in by and anchor:
        x = anchor["ratio_median"]
        out.append(
            (
                f"(a) >= {TARGETS['vs_infinity']:g}x Infinity in the same run and precision, (e) "
                f"({x:.2f}x, per round {', '.join(f'{v:.2f}' for v in anchor['ratios'])})",
                x >= TARGETS["vs_infinity"],
            )
        )
    elif "(a)" in by:
        x = by["(a)"]["pairs_per_s"] / INFINITY_PAIRS_PER_S
        out.append(
            (
                f"(a) >= {TARGETS['vs_infinity']:g}x the Infinity anchor of {INFINITY_PAIRS_PER_S:g} pairs/s "
                f"({x:.2f}x)",
                x >= TARGETS["vs_infinity"],
            )
        )
    if "(a)" in by:
        p50 = by["(a)"]["p50_ms"]
        out.append((f"(a) p50 <= {TARGETS['p50_ms']:g} ms ({p50:.0f} ms)", p50 <= TARGETS["p50_ms"]))
    if "(d)" in by and "(a)" in by:
        x = by["(a)"]["pairs_per_s"] / max(by["(d)"]["pairs_per_s"], 1e-9)
        out.append((f"(a) >= {TARGETS['vs_naive']:g}x the naive server ({x:.2f}x)", x >= TARGETS["vs_naive"]))
    return [{"target": t, "pass": ok} for t, ok in out]


async def drive_qtrel(
    base: str, a, bodies_a: list[Body], bodies_b: list[Body], pid: int | None, anchor: tuple | None = None
) -> list[dict]:
    """(a), (b), (c); with `anchor` = (Infinity's url, pid, bodies), (a) and Infinity's (e) alternate over
    --anchor-rounds rounds (order swapped each round) before (b) and (c)."""
    with urllib.request.urlopen(base + "/info", timeout=10) as r:
        info = json.load(r)
    a.server_worker = info.get("worker")
    # what runs the forward (QTREL_INFERENCE) and why: the first model process's, as /info shows it
    a.server_inference = {k: info.get("model", {}).get(k) for k in ("inference", "inference_reason")}
    name_a = f"(a) {a.clients} clients x 1 pair"
    if anchor is None:
        a_res = await scenario(name_a, base, bodies_a, a, pid, clients=a.clients)
        extra: list[dict] = []
    else:
        url, inf_pid, inf_bodies = anchor
        rounds: list[tuple[dict, dict]] = []
        for i in range(a.anchor_rounds):

            async def ours(i: int = i) -> dict:
                return await scenario(f"{name_a}, round {i + 1}", base, bodies_a, a, pid, clients=a.clients)

            async def theirs(i: int = i) -> dict:
                return await scenario(
                    f"(e) Infinity {a.infinity_dtype}, {a.clients} clients x 1 pair, round {i + 1}",
                    url,
                    inf_bodies,
                    a,
                    inf_pid,
                    clients=a.clients,
                    metrics=False,
                    path="/rerank",
                )

            if i % 2 == 0:
                q, t = await ours(), await theirs()
            else:
                t, q = await theirs(), await ours()
            rounds.append((q, t))
        a.infinity_result = {
            "ratios": [q["pairs_per_s"] / max(t["pairs_per_s"], 1e-9) for q, t in rounds],
        }
        a.infinity_result["ratio_median"] = statistics.median(a.infinity_result["ratios"])
        a_res = rounds[0][0] | {"name": name_a}  # round 1 runs first, as (a) does without the anchor
        extra = [s for pair in rounds for s in pair]
    b_res = await scenario(
        f"(b) {a.query_clients} clients x 1 query, {a.titles} titles", base, bodies_b, a, pid, clients=a.query_clients
    )
    rate = max(1.0, a.load_fraction * a_res["requests_per_s"])
    c_res = await scenario(
        f"(c) open loop, Poisson {rate:.0f} req/s ({a.load_fraction:.0%} of (a))", base, bodies_a, a, pid, rate=rate
    )
    a_res["offline_set"], b_res["offline_set"] = "one pair", "query x titles"
    return [a_res, b_res, c_res, *extra]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in model)")
    p.add_argument("--url", help="target this running server (loopback only) instead of starting one")
    p.add_argument(
        "--cores",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="cores the offline runs and the naive server use (default: all usable)",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="extra `qtrel serve` flags, e.g. '--replicas 1 --threads 2' (default: the server's own layout)",
    )
    p.add_argument("--dtype", default="auto", help="precision of the server and the offline run (as QTREL_DTYPE)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured seconds per scenario")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds per scenario before measuring")
    p.add_argument("--pairs", type=int, default=4000, help="dev pairs cycled through by one-pair requests")
    p.add_argument("--queries", type=int, default=80, help="dev queries cycled through by (b)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--query-clients", type=int, default=8)
    p.add_argument("--titles", type=int, default=50)
    p.add_argument("--load-fraction", type=float, default=0.7, help="(c)'s arrival rate, a fraction of (a)")
    p.add_argument("--offline-repeats", type=int, default=3)
    p.add_argument("--no-naive", action="store_true", help="skip (d), the naive transformers server")
    p.add_argument(
        "--infinity",
        help="infinity_emb executable for (e) (default: $QTREL_BENCH_INFINITY, then "
        f"{infinity_anchor.DEFAULT_EXE}, then PATH)",
    )
    p.add_argument("--no-infinity", action="store_true", help="skip (e), Infinity in the same run")
    p.add_argument("--tag", default="", help="a label kept in the JSON (the table is this machine kind's)")
    p.add_argument("--title", default="", help="the table's heading (default: this machine's CPU and ISA)")
    p.add_argument("--anchor-rounds", type=int, default=2, help="rounds of (a) and (e), interleaved")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a tiny random checkpoint, 64 pairs, 1 s per scenario, into a scratch folder",
    )
    a = p.parse_args()
    tmp_model = tempfile.TemporaryDirectory(prefix="qtrel-load-model-")
    if a.quick:
        a.seconds, a.warmup, a.pairs, a.queries, a.offline_repeats, a.anchor_rounds = 1.0, 0.3, 64, 4, 1, 1
        a.cores = 1  # one offline layout, one process per pair set
        a.model = a.model or tiny_checkpoint(Path(tmp_model.name) / "tiny")
    if a.model is None:
        from model.builtin import builtin_dir

        a.model = builtin_dir()
    if not (a.model / "config.json").is_file():
        raise SystemExit(f"{a.model} is not a checkpoint (no config.json); pass --model DIR")
    base = loopback_url(a.url) if a.url else f"http://127.0.0.1:{free_port()}"
    rows = read_dev()
    bodies_a, pairs_a = one_pair_bodies(rows, a.pairs)
    bodies_b, pairs_b = query_bodies(rows, a.queries, a.titles)
    offline, layouts = offline_pairs_per_s(
        a.model, {"one pair": pairs_a, "query x titles": pairs_b}, a.cores, a.offline_repeats, a.dtype
    )
    report = {
        "machine": machine(),
        "command": command_line(),
        "model": str(a.model),
        "cores": a.cores,
        "dtype": a.dtype,
        "seconds": a.seconds,
        "warmup": a.warmup,
        "load_fraction": a.load_fraction,
        "offline": offline,
        "offline_layouts": layouts,
        "http_client": Http(1).kind,
        "quick": a.quick,
        "server": f"--url {base} (its own settings)" if a.url else "started by this script",
        "title": a.title or default_title(isa()),
        "tag": a.tag,
    }
    inf_exe = None if (a.no_infinity or a.url) else infinity_anchor.find_infinity(a.infinity)
    from model.device import resolve_dtype

    a.infinity_dtype = resolve_dtype(a.dtype, "cpu")
    with tempfile.TemporaryDirectory(prefix="qtrel-load-") as tmp:
        if a.url:
            report["scenarios"] = asyncio.run(drive_qtrel(base, a, bodies_a, bodies_b, None))
        else:
            cmd = qtrel_command(a.model, int(urlsplit(base).port or 0), a.dtype, a.server_args.split())
            if inf_exe is None:
                with Server(cmd, base, "/health/ready", Path(tmp) / "qtrel.log", a.start_timeout) as srv:
                    report["scenarios"] = asyncio.run(drive_qtrel(base, a, bodies_a, bodies_b, srv.proc.pid))
            else:
                ck = infinity_anchor.one_output_checkpoint(a.model, Path(tmp) / "infinity-checkpoint")
                port = free_port()
                inf_cmd = infinity_anchor.command(inf_exe, ck, port, a.infinity_dtype)
                inf_url = f"http://127.0.0.1:{port}"
                report["infinity_server"] = {
                    "version": infinity_anchor.version(inf_exe),
                    "dtype": a.infinity_dtype,
                    "torch_threads": a.cores,
                    "command": " ".join(inf_cmd[1:]),
                }
                inf_bodies = infinity_anchor.rerank_bodies(pairs_a)
                with (
                    Server(
                        inf_cmd,
                        inf_url,
                        "/health",
                        Path(tmp) / "infinity.log",
                        a.start_timeout,
                        infinity_anchor.env(a.cores),
                    ) as inf,
                    Server(cmd, base, "/health/ready", Path(tmp) / "qtrel.log", a.start_timeout) as srv,
                ):
                    anchor = (inf_url, inf.proc.pid, inf_bodies)
                    report["scenarios"] = asyncio.run(drive_qtrel(base, a, bodies_a, bodies_b, srv.proc.pid, anchor))
                report["infinity"] = a.infinity_result
        if not a.no_naive:
            port = free_port()
            cmd = [
                sys.executable,
                str(Path(__file__).parent / "harness" / "naive_server.py"),
                "--model",
                str(a.model),
                "--port",
                str(port),
                "--threads",
                str(a.cores),
            ]
            naive = f"http://127.0.0.1:{port}"
            with Server(cmd, naive, "/health", Path(tmp) / "naive.log", a.start_timeout) as srv:
                d = asyncio.run(
                    scenario(
                        f"(d) naive transformers server, {a.clients} clients x 1 pair",
                        naive,
                        bodies_a,
                        a,
                        srv.proc.pid,
                        clients=a.clients,
                        metrics=False,
                    )
                )
            report["scenarios"].append(d)
    report["server_worker"] = getattr(a, "server_worker", None)
    report["server_inference"] = getattr(a, "server_inference", None)
    report["targets"] = targets(report)
    inf_note = (
        f"(e) Infinity ({report['infinity_server']['version']}, dtype {a.infinity_dtype}, {a.cores} torch threads, "
        "one process) serves the same encoder and tokenizer with a one-output head (bench/harness/infinity.py) on "
        "its /rerank route, one pair per request, started beside qtrel and interleaved with (a); "
        "(a) in the table is its round 1."
        if "infinity_server" in report
        else INFINITY
    )
    report["notes"] = [
        inf_note,
        f"Pools: (a), (c), (d) cycle through the first {len(pairs_a)} dev pairs; (b) through "
        f"{len(bodies_b)} dev queries, each with its own titles then other dev titles up to {a.titles}, all distinct.",
        "(c) latency is measured from each request's scheduled arrival (no coordinated omission).",
        "(d) answers each request with its own forward on FastAPI's thread pool (several at once), "
        f"torch threads = {a.cores}, the same checkpoint in transformers (sdpa, float32).",
        "Client and server share this machine's cores; their CPU use is in the table.",
    ]
    if a.quick:
        report["notes"].append("--quick smoke run: tiny sizes, numbers are not benchmarks.")
    text = render(report)
    print("\n" + text)
    publish("load", report, text, a.quick)
    tmp_model.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
