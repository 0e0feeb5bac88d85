"""Memory of `qtrel serve` beside Infinity's on the same encoder, one server after the other (issue 20).

Each server is started, warmed (its own warm-up, then a one-pair request whose latency is the first
request's, then a few requests of one pair and of 50 titles), left idle for a few seconds, and its whole
process tree read from `/proc/<pid>/smaps_rollup`: RSS (which counts a shared page once in every process
that maps it), PSS (a shared page split among its sharers: the tree's sum is what it holds) and USS
(Private_Clean + Private_Dirty: what that one process alone holds). Then a closed-loop load of one-pair
requests gives pairs/s, and the tree is read again after it.

  python bench/memory.py                                  # qtrel (template), qtrel (spawn), Infinity
  python bench/memory.py --systems template --quick       # one system, to /tmp/qtrel-bench-quick
  python bench/memory.py --systems torch openvino --tag=-openvino   # the two forwards, pinned

qtrel is `qtrel serve` on its default model and layout (score cache off, as bench/load.py), once with
`--process-start template` (the default: model processes forked from one warm template) and once with
`--process-start spawn` (each model process loads and warms its own, as before). Infinity is
`bench/harness/infinity.py`'s: the same encoder in the precision qtrel serves here, a one-output head,
2 torch threads.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import infinity as infinity_anchor
from harness.data import one_pair_bodies, query_bodies, read_dev, tiny_checkpoint
from harness.live import post_all
from harness.machine import isa, isa_line
from harness.publish import ROOT, command_line, machine, publish
from harness.server import Server, free_port, tree

from model.device import resolve_dtype

MODEL = ROOT / "model" / "default"
SYSTEMS = ("template", "spawn", "torch", "openvino", "infinity")
# qtrel systems: (process start, inference); "template" and "spawn" keep the server's default inference (auto)
QTREL = {"template": ("template", None), "spawn": ("spawn", None), "torch": ("template", "torch")}
QTREL["openvino"] = ("template", "openvino")


def smaps(pid: int) -> dict[str, int] | None:
    """RSS, PSS, USS and anonymous memory of one process, in KiB (None when it is gone)."""
    d: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            p = line.split()
            if len(p) >= 2 and p[1].isdigit():
                d[p[0].rstrip(":")] = int(p[1])
    except OSError:
        return None
    return {"rss": d["Rss"], "pss": d["Pss"], "uss": d["Private_Clean"] + d["Private_Dirty"], "anon": d["Anonymous"]}


def role(pid: int, parent: int, root: int, system: str) -> str:
    if pid == root:
        return "Infinity (one process)" if system == "infinity" else "HTTP server"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = ""
    if "resource_tracker" in cmd:
        return "multiprocessing resource tracker"
    if "forkserver" in cmd and parent == root:
        return "fork server (the template)"
    if "forkserver" in cmd or "spawn_main" in cmd:
        return "model process"
    return cmd[:60] or "?"


def read_tree(root: int, system: str) -> list[dict]:
    rows = []
    for pid, parent in tree(root):
        m = smaps(pid)
        if m is not None:
            rows.append({"pid": pid, "role": role(pid, parent, root, system), **m})
    return rows


def resident_frames(pid: int):
    """The physical page frames a process has resident (/proc/<pid>/pagemap: frame numbers need root), or None."""
    import numpy as np

    page = os.sysconf("SC_PAGE_SIZE")
    frames = []
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pm:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if line.rstrip().endswith("[vsyscall]"):
                    continue
                pm.seek(lo // page * 8)
                e = np.frombuffer(pm.read((hi - lo) // page * 8), dtype=np.uint64)
                present = e[(e >> np.uint64(63)) & np.uint64(1) == 1] & np.uint64((1 << 55) - 1)
                frames.append(present)
    except OSError:
        return None
    out = np.concatenate(frames) if frames else np.zeros(0, dtype=np.uint64)
    return None if out.size and not out.any() else out  # all zero: not root, frame numbers hidden


def distinct_mb(pids: list[int]) -> float | None:
    """MiB of distinct physical pages resident in these processes: each shared page once (what PSS
    approximates), checked by frame number."""
    import numpy as np

    sets = [resident_frames(p) for p in pids]
    if any(s is None for s in sets):
        return None
    return round(np.unique(np.concatenate(sets)).size * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def totals(rows: list[dict]) -> dict[str, int]:
    return {k: sum(r[k] for r in rows) for k in ("rss", "pss", "uss", "anon")}


async def drive(url: str, route: str, one: list, many: list) -> dict:
    """First request, then the warm requests, then the load: latencies and pairs/s."""
    _, first, _ = await post_all(url + route, [one[0][0]], 1)
    await post_all(url + route, [b for b, _ in one[1:21]], 4)
    if many:
        await post_all(url + route, [b for b, _ in many], 2)
    return {"first_request_ms": round(first[0] * 1000, 1)}


async def load_phase(url: str, route: str, load: list, clients: int) -> dict:
    answers, lat, wall = await post_all(url + route, [b for b, _ in load], clients)
    ok = sum(1 for a in answers if a is not None)
    lat.sort()
    p50 = round(lat[len(lat) // 2] * 1000, 1)
    return {"requests": len(load), "ok": ok, "pairs_per_s": round(ok / wall, 1), "p50_ms": p50}


def measure(system: str, a, tmp: Path, one, many, load, inf_one, inf_load) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if system == "infinity":
        exe = infinity_anchor.find_infinity(a.infinity)
        if exe is None:
            raise SystemExit("no infinity_emb found (bench/harness/infinity.py says how to install it)")
        ck = tmp / "infinity-checkpoint"
        if not ck.is_dir():  # once, for every round
            infinity_anchor.one_output_checkpoint(a.model, ck)
        cmd = infinity_anchor.command(exe, ck, port, resolve_dtype("auto", "cpu"))  # the precision qtrel serves
        srv = Server(cmd, url, "/health", tmp / "infinity.log", a.start_timeout, infinity_anchor.env(2))
        route, bodies_one, bodies_many, bodies_load = "/rerank", inf_one, [], inf_load
        extra = {"version": infinity_anchor.version(exe), "command": " ".join(cmd[1:])}
    else:
        cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(a.model), "--host", "127.0.0.1"]
        start, inference = QTREL[system]
        cmd += ["--port", str(port), "--log-level", "warning", "--cache-mb", "0", "--process-start", start]
        cmd += ["--inference", inference] if inference else []
        srv = Server(cmd, url, "/health/ready", tmp / f"qtrel-{system}.log", a.start_timeout)
        route, bodies_one, bodies_many, bodies_load = "/score", one, many, load
        extra = {"command": " ".join(cmd[3:])}
    t0 = time.monotonic()
    with srv:
        ready_s = round(time.monotonic() - t0, 1)
        out = asyncio.run(drive(url, route, bodies_one, bodies_many))
        time.sleep(a.settle)
        idle = read_tree(srv.proc.pid, system)
        idle_distinct = distinct_mb([p["pid"] for p in idle])
        out.update(asyncio.run(load_phase(url, route, bodies_load, a.clients)))
        time.sleep(a.settle)
        after = read_tree(srv.proc.pid, system)
        after_distinct = distinct_mb([p["pid"] for p in after])
    print(f"{system}: ready {ready_s}s, idle {totals(idle)} ({idle_distinct} MB distinct), {out}", flush=True)
    return {
        "system": system,
        "ready_s": ready_s,
        **out,
        "idle": idle,
        "idle_distinct_mb": idle_distinct,
        "after_load": after,
        "after_load_distinct_mb": after_distinct,
        **extra,
    }


def mb(kib: int) -> str:
    return f"{kib / 1024:,.0f}"


NAMES = {
    "template": "qtrel serve, `--process-start template` (default)",
    "spawn": "qtrel serve, `--process-start spawn` (before)",
    "torch": "qtrel serve, `--inference torch`",
    "openvino": "qtrel serve, `--inference openvino`",
    "infinity": "Infinity",
}


def spread(xs: list[float]) -> str:
    """Median, and the range where there are several rounds."""
    m = statistics.median(xs)
    return f"{m:,.1f}" if len(xs) == 1 else f"{m:,.1f} ({min(xs):,.1f}-{max(xs):,.1f})"


def render(r: dict) -> str:
    runs = {x["system"]: x for x in r["runs"] if x["round"] == 0}  # memory: the first round
    rounds: dict[str, list[dict]] = {}
    for x in r["runs"]:
        rounds.setdefault(x["system"], []).append(x)
    lines = [
        f"### Memory of `qtrel serve` beside Infinity: {r['isa']['model_name']}, {r['isa']['microarchitecture']} "
        f"(`bench/memory.py`, {r['machine']['date']})",
        "",
        f"{r.get('dtype', 'bfloat16')}; warmed ({r['warm_requests']}), idle {r['settle_s']:g} s; then "
        f"{r['load_requests']} one-pair requests from {r['clients']} clients; {r['repeats']} round(s): memory from "
        "the first, speed as median (range).",
        "",
        f"- ISA: {r['isa_line']}",
        f"- command: `{r['command']}`",
        f"- load: 1-minute load average before {r['loadavg_before']:.1f}, after {r['loadavg_after']:.1f} "
        "(other sessions' jobs may share the 2 vCPUs)",
    ]
    if "infinity" in runs:
        lines.append(f"- Infinity: {runs['infinity']['version']}")
    lines += [
        "",
        "| server | process | RSS MB | PSS MB | USS MB |",
        "|---|---|---:|---:|---:|",
    ]
    for s in SYSTEMS:
        if s not in runs:
            continue
        by_role: dict[str, list[dict]] = {}
        for p in runs[s]["idle"]:
            by_role.setdefault(p["role"], []).append(p)
        for name, ps in by_role.items():
            each = f" (each of {len(ps)})" if len(ps) > 1 else ""
            avg = {k: sum(p[k] for p in ps) // len(ps) for k in ("rss", "pss", "uss")}
            lines.append(f"| {NAMES[s]} | {name}{each} | {mb(avg['rss'])} | {mb(avg['pss'])} | {mb(avg['uss'])} |")
        t = totals(runs[s]["idle"])
        lines.append(f"| {NAMES[s]} | **all, idle** | **{mb(t['rss'])}** | **{mb(t['pss'])}** | {mb(t['uss'])} |")
    lines += [
        "",
        "| server | ready s | first request ms | pairs/s (one-pair, closed loop) | p50 ms "
        "| idle MB: PSS / distinct pages | after load MB: PSS / distinct pages / RSS |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in SYSTEMS:
        if s in runs:
            x, xs = runs[s], rounds[s]
            idle, after = totals(x["idle"]), totals(x["after_load"])
            speed = " | ".join(
                spread([y[k] for y in xs]) for k in ("ready_s", "first_request_ms", "pairs_per_s", "p50_ms")
            )
            lines.append(
                f"| {NAMES[s]} | {speed} | "
                f"{mb(idle['pss'])} / {x['idle_distinct_mb']:,.0f} | {mb(after['pss'])} / "
                f"{x['after_load_distinct_mb']:,.0f} / {mb(after['rss'])} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", nargs="+", default=["template", "spawn", "infinity"], choices=SYSTEMS)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--load-requests", type=int, default=1500, help="one-pair requests of the load phase")
    p.add_argument("--settle", type=float, default=5.0, help="idle seconds before each reading")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--infinity", help="infinity_emb executable (default: bench/harness/infinity.py's search)")
    p.add_argument("--model", type=Path, default=MODEL, help="checkpoint (default: model/default)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of all systems, interleaved (speed: median, range)")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, 40 requests, scratch")
    p.add_argument("--tag", default="", help="a label kept in the JSON (the table is this machine kind's)")
    a = p.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="qtrel-memory-model-")
    if a.quick:
        a.model, a.load_requests, a.settle = tiny_checkpoint(Path(scratch.name) / "tiny"), 40, 0.2
        if infinity_anchor.find_infinity(a.infinity) is None:  # absent here: the rest still runs
            a.systems = [s for s in a.systems if s != "infinity"]
    rows = read_dev()
    one, pairs = one_pair_bodies(rows, 21 + a.load_requests)
    many, _ = query_bodies(rows, 5, 50)
    inf_one = infinity_anchor.rerank_bodies(pairs[:21])
    inf_load = infinity_anchor.rerank_bodies(pairs[21:])
    report = {
        "machine": machine(),
        "isa": isa(),
        "command": command_line(),
        "clients": a.clients,
        "repeats": a.repeats,
        "load_requests": a.load_requests,
        "settle_s": a.settle,
        "dtype": resolve_dtype("auto", "cpu"),
        "warm_requests": "20 one-pair requests and, for qtrel, 5 requests of 50 titles",
        "loadavg_before": os.getloadavg()[0],
        "model": str(a.model),
        "tag": a.tag,
        "quick": a.quick,
    }
    report["isa_line"] = isa_line(report["isa"])
    with tempfile.TemporaryDirectory(prefix="qtrel-memory-") as tmp:
        report["runs"] = [
            {**measure(s, a, Path(tmp), one, many, one[21:], inf_one, inf_load), "round": k}
            for k in range(a.repeats)
            for s in SYSTEMS
            if s in a.systems
        ]
    report["loadavg_after"] = os.getloadavg()[0]
    print(render(report))
    publish("memory", report, render(report), a.quick)
    scratch.cleanup()


if __name__ == "__main__":
    main()
