"""Bounded load test of `qtrel serve` on loopback: throughput, latency and padding beside offline speed.

Starts `qtrel serve --model DIR` as a subprocess (or targets --url, loopback only), waits for
/health/ready, and drives it from this process (its own event loop, never the server's):
  (a) 64 concurrent clients, one pair per request;
  (b) 8 clients, one query x 50 titles per request (real dev queries with their titles, then other dev
      titles up to 50, all distinct);
  (c) an open-loop Poisson arrival schedule of one-pair requests at 70% of (a)'s throughput;
  (d) scenario (a) against bench/naive_server.py (transformers, one forward per request);
  (e) scenario (a) against Infinity (`bench/infinity_anchor.py`) in the same precision, where it is
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
import csv
import ipaddress
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from itertools import cycle
from pathlib import Path
from urllib.parse import urlsplit

import infinity_anchor
from results import DEV, ROOT, command_line, machine, machine_lines, output_paths, update_section, verdict, write_json

# vs_infinity and p50_ms: issue 20 (64 one-pair clients >= 4x Infinity in the same run and precision, p50 <= 100 ms)
TARGETS = {"vs_offline": 0.85, "p99_over_p50": 3.0, "vs_naive": 3.0, "vs_infinity": 4.0, "p50_ms": 100.0}
INFINITY_PAIRS_PER_S = 112.0
INFINITY = (
    f"Infinity anchor, measured elsewhere and not re-run here: ~{INFINITY_PAIRS_PER_S:.0f} pairs/s, "
    "p50 ~540 ms, p99 ~850 ms for 64 one-pair clients."
)
Body = tuple[bytes, int]  # JSON request body, pairs in it


def loopback_url(url: str) -> str:
    host = urlsplit(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"refusing {url!r}: this load generator only targets loopback addresses")
    return url.rstrip("/")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- workload ------------------------------------------------------------------------------------
def read_dev() -> list[dict]:
    with DEV.open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def one_pair_bodies(rows: list[dict], n: int) -> tuple[list[Body], list[tuple[str, str]]]:
    pairs = [(r["query"], r["title"]) for r in rows[:n]]
    bodies = [(json.dumps({"pairs": [{"query": q, "title": t}], "return_probs": False}).encode(), 1) for q, t in pairs]
    return bodies, pairs


def query_bodies(rows: list[dict], n_queries: int, n_titles: int) -> tuple[list[Body], list[tuple[str, str]]]:
    """One body per dev query: its own titles, then other dev titles up to n_titles, all distinct (the
    server computes a repeated pair once, so repeats would measure its dedup, not the forward path)."""
    by_query: dict[str, list[str]] = {}
    for r in rows:
        by_query.setdefault(r["query"], []).append(r["title"])
    pool = list(dict.fromkeys(r["title"] for r in rows))
    bodies, pairs = [], []
    for i, (q, own) in enumerate(list(by_query.items())[:n_queries]):
        titles = list(dict.fromkeys(own))
        others = (t for t in pool[i * n_titles :] + pool if t not in titles)
        titles += [t for t, _ in zip(others, range(n_titles - len(titles)))]
        titles = titles[:n_titles]
        bodies.append((json.dumps({"query": q, "titles": titles, "return_probs": False}).encode(), n_titles))
        pairs += [(q, t) for t in titles]
    return bodies, pairs


def _offline_share(model_dir: str, dtype: str, threads: int, pairs: list, repeats: int, start, out) -> None:
    """One offline process: load, warm up, wait for the others, then time predict `repeats` times."""
    import torch

    from model.relevance import RelevanceModel

    torch.set_num_threads(threads)
    m = RelevanceModel.load(model_dir, dtype=dtype)
    m.predict(pairs)
    start.wait()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m.predict(pairs)
        times.append(time.perf_counter() - t0)
    out.put(times)


def offline_pairs_per_s(
    model_dir: Path, pair_sets: dict[str, list], cores: int, repeats: int, dtype: str = "auto"
) -> tuple[dict, dict]:
    """RelevanceModel.predict over each pair set (length-sorted, 8192-token batches), laid out two ways
    on the same cores: one process with `cores` torch threads, and `cores` single-thread processes each
    scoring its share at the same time. The reference is the faster of the two, per pair set.
    Returns ({set: best pairs/s}, {set: {layout: pairs/s}})."""
    import multiprocessing as mp

    import torch

    from model.device import resolve_dtype
    from model.parallel import plan

    dtype = resolve_dtype(dtype, torch.device("cpu"))
    print(f"offline: {dtype}")
    ctx = mp.get_context("spawn")
    best, layouts = {}, {}
    for name, pairs in pair_sets.items():
        layouts[name] = {}
        for procs, threads in ((1, cores), (cores, 1)) if cores > 1 else ((1, 1),):
            start, out = ctx.Barrier(procs), ctx.Queue()
            shares = [pairs[i::procs] for i in range(procs)]
            workers = [
                ctx.Process(target=_offline_share, args=(str(model_dir), dtype, threads, share, repeats, start, out))
                for share in shares
            ]
            for w in workers:
                w.start()
            times = [out.get() for _ in workers]
            for w in workers:
                w.join()
            # repeat r ends when its slowest process ends; median over repeats
            wall = statistics.median(max(t[r] for t in times) for r in range(repeats))
            layout = f"{procs} process{'es' if procs > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
            if plan(threads)[0] > 1:  # predict forwards its batches on workers (model.parallel)
                layout += f" ({plan(threads)[0]} forward workers)"
            layouts[name][layout] = len(pairs) / wall
            print(f"offline {name}, {layout}: {layouts[name][layout]:.0f} pairs/s over {len(pairs)} pairs")
        best[name] = max(layouts[name].values())
    return best, layouts


# --- HTTP client ---------------------------------------------------------------------------------
class Http:
    """aiohttp when installed (lighter on the CPU the server also needs), else httpx."""

    def __init__(self, connections: int):
        self.connections = connections
        try:
            import aiohttp  # noqa: F401

            self.kind = "aiohttp"
        except ImportError:
            self.kind = "httpx"
            print(
                "warning: aiohttp not installed, using httpx, which takes about a core at 64 clients and becomes the"
                " bottleneck on 2 cores (pip install -e '.[bench]')",
                file=sys.stderr,
            )

    async def __aenter__(self) -> Http:
        if self.kind == "aiohttp":
            import aiohttp

            self.s = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections), timeout=aiohttp.ClientTimeout(total=120)
            )
        else:
            import httpx

            limits = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)
            self.s = httpx.AsyncClient(limits=limits, timeout=120)
        return self

    async def __aexit__(self, *exc) -> None:
        await (self.s.close() if self.kind == "aiohttp" else self.s.aclose())

    async def post(self, url: str, body: bytes) -> int:
        headers = {"content-type": "application/json"}
        if self.kind == "aiohttp":
            async with self.s.post(url, data=body, headers=headers) as r:
                await r.read()
                return r.status
        return (await self.s.post(url, content=body, headers=headers)).status_code

    async def get_text(self, url: str) -> str:
        if self.kind == "aiohttp":
            async with self.s.get(url) as r:
                return await r.text()
        return (await self.s.get(url)).text


async def send(http: Http, url: str, body: Body, t_ref: float, records: list) -> None:
    """One request; records (reference time, end, pairs, status). The open loop's reference time is the
    scheduled arrival, so time spent waiting on the client side counts as latency."""
    try:
        status = await http.post(url, body[0])
    except Exception as e:  # a failed request is a result, not a crash of the run
        status = type(e).__name__
    records.append((t_ref, time.perf_counter(), body[1], status))


async def closed_loop(http: Http, url: str, bodies: list[Body], clients: int, end: float) -> list:
    records: list = []
    it = cycle(bodies)

    async def client() -> None:
        while (now := time.perf_counter()) < end:
            await send(http, url, next(it), now, records)

    await asyncio.gather(*(client() for _ in range(clients)))
    return records


async def open_loop(http: Http, url: str, bodies: list[Body], rate: float, end: float, cap: int) -> list:
    """Poisson arrivals at `rate` requests/s until `end`; at most `cap` in flight (beyond: counted, not sent)."""
    records: list = []
    rng, it, tasks = random.Random(0), cycle(bodies), set()
    t = time.perf_counter()
    while (t := t + rng.expovariate(rate)) < end:
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        if len(tasks) >= cap:
            records.append((t, t, 1, "client cap"))
            continue
        task = asyncio.create_task(send(http, url, next(it), t, records))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return records


def metrics_of(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page by name, summed over their labels (the batch metrics carry a
    `model` label since the server serves several models)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.split("{", 1)[0].split()[0], line.rsplit(None, 1)[-1]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def tree(root: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of `root` and of all its descendants: qtrel's model processes are grandchildren
    (forked by the template's fork server, a child of the HTTP process)."""
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [(root, parents.get(root, 0))], [root]
    while todo:
        p = todo.pop()
        kids = sorted(c for c, pp in parents.items() if pp == p)
        out += [(c, p) for c in kids]
        todo += kids
    return out


def own_cpu_seconds(pid: int) -> float:
    """CPU time of one live process (utime + stime); 0 once it has gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and every live process below it (the fork server and the model processes)."""
    return sum(own_cpu_seconds(p) for p, _ in tree(pid))


async def scenario(
    name: str,
    base: str,
    bodies: list[Body],
    a,
    server_pid: int | None,
    *,
    clients: int = 0,
    rate: float = 0.0,
    metrics: bool = True,
    path: str = "/score",
) -> dict:
    """Run one scenario: closed loop with `clients`, or open loop at `rate`; summarise its window."""
    async with Http(clients or 512) as http, Http(1) as control:  # scrapes never wait behind the load
        t0 = time.perf_counter()
        start, end = t0 + a.warmup, t0 + a.warmup + a.seconds
        run = (
            closed_loop(http, base + path, bodies, clients, end)
            if clients
            else open_loop(http, base + path, bodies, rate, end, 512)
        )
        task = asyncio.ensure_future(run)
        await asyncio.sleep(a.warmup)
        cpu0 = (time.process_time(), cpu_seconds(server_pid) if server_pid else 0.0)
        before = metrics_of(await control.get_text(base + "/metrics")) if metrics else {}
        records = await task
        wall = time.perf_counter() - start
        cpu = (time.process_time() - cpu0[0], (cpu_seconds(server_pid) - cpu0[1]) if server_pid else None)
        after = metrics_of(await control.get_text(base + "/metrics")) if metrics else {}
    done = [r for r in records if r[3] == 200 and start <= r[1] <= end]
    lat = sorted(1000 * (r[1] - r[0]) for r in records if r[3] == 200 and start <= r[0] < end)
    errors: dict[str, int] = {}
    for r in records:
        if r[3] != 200 and start <= r[0] < end:
            errors[str(r[3])] = errors.get(str(r[3]), 0) + 1
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [float("nan")] * 99
    out = {
        "name": name,
        "clients": clients or None,
        "target_rate": rate or None,
        "pairs_per_s": sum(r[2] for r in done) / a.seconds,
        "requests_per_s": len(done) / a.seconds,
        "requests": len(lat),
        "p50_ms": q[49],
        "p95_ms": q[94],
        "p99_ms": q[98],
        "errors": errors,
        "client_cpu_s": cpu[0],
        "server_cpu_s": cpu[1],
        "client_cores": cpu[0] / wall,
        "server_cores": None if cpu[1] is None else cpu[1] / wall,
    }
    if metrics:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        n = d.get("qtrel_batch_pairs_count", 0.0)
        out["mean_padding"] = d.get("qtrel_batch_padding_ratio_sum", 0.0) / n if n else None
        out["mean_batch_pairs"] = d.get("qtrel_batch_pairs_sum", 0.0) / n if n else None
    print(
        f"{name}: {out['pairs_per_s']:.0f} pairs/s, p50 {out['p50_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms, "
        f"errors {errors or 0}"
    )
    return out


# --- servers -------------------------------------------------------------------------------------
class Server:
    """A server subprocess: started, polled until ready, stopped with SIGTERM (it drains, then exits)."""

    def __init__(
        self, cmd: list[str], url: str, ready_path: str, log: Path, timeout: float, env: dict[str, str] | None = None
    ):
        self.cmd, self.url, self.ready_path, self.log, self.timeout = cmd, url, ready_path, log, timeout
        self.env = env

    def __enter__(self) -> Server:
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT, env=self.env
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.cmd[0]} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        self.__exit__()
        raise SystemExit(f"{self.url} not ready after {self.timeout:.0f}s:\n{self.tail()}")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])


def qtrel_command(model_dir: Path, port: int, dtype: str = "auto", extra: list[str] | None = None) -> list[str]:
    """`qtrel serve` with its default layout of model processes and threads unless `extra` says otherwise, and
    the score cache off: these loads replay the same bodies window after window, so with the cache they
    would measure its hits, not the forward path (bench/cache_replay.py measures the cache)."""
    exe = Path(sys.executable).with_name("qtrel")
    return [
        str(exe) if exe.exists() else "qtrel",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--log-level",
        "warning",
        "--cache-mb",
        "0",
        *(extra or []),
    ]


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


def render(r: dict) -> str:
    lines = [
        f"{'###' if r.get('title') else '##'} Serving under load (`bench/load.py`){r.get('title', '')}",
        "",
        f"`qtrel serve` (dtype {r.get('dtype', 'auto')}, {worker_text(r.get('server_worker'))}, "
        f"{inference_text(r.get('server_inference'))}default batching settings) on loopback, driven from "
        f"a separate client process ({r['http_client']}); each scenario {r['warmup']:g} s warm-up + {r['seconds']:g} "
        "s measured. Latency per request; padding and batch size from the server's /metrics over the window. "
        "Offline = RelevanceModel.predict on the same pairs in this run (length-sorted, 8192-token batches) on the "
        f"same {r['cores']} cores, the faster of two layouts: "
        + "; ".join(
            f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in lay.items())
            for name, lay in r.get("offline_layouts", {}).items()
        )
        + " pairs/s.",
        "",
        *machine_lines(r["machine"], r["command"]),
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
    lines += ["", *[f"- {n}" for n in r["notes"]]]
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
    p.add_argument("--tag", default="", help="suffix of the JSON file and the docs section, e.g. -zen-4")
    p.add_argument("--title", default="", help="added to the section's heading, e.g. ': AMD EPYC Zen 4'")
    p.add_argument("--anchor-rounds", type=int, default=2, help="rounds of (a) and (e), interleaved")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 64 pairs, 2 s per scenario, results under /tmp/qtrel-bench-quick",
    )
    a = p.parse_args()
    if a.quick:
        a.seconds, a.warmup, a.pairs, a.queries, a.offline_repeats = 2.0, 0.5, 64, 4, 1
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
    md, js = output_paths(f"load{a.tag}", a.quick)
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
        "title": a.title,
    }
    inf_exe = None if (a.no_infinity or a.url) else infinity_anchor.find_infinity(a.infinity)
    from model.device import resolve_dtype

    a.infinity_dtype = resolve_dtype(a.dtype, "cpu")
    with tempfile.TemporaryDirectory(prefix="qtrel-load-") as tmp:
        if a.url:
            report["scenarios"] = asyncio.run(drive_qtrel(base, a, bodies_a, bodies_b, None))
        else:
            cmd = qtrel_command(a.model, int(urlsplit(base).port), a.dtype, a.server_args.split())
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
                str(Path(__file__).with_name("naive_server.py")),
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
        "one process) serves the same encoder and tokenizer with a one-output head (bench/infinity_anchor.py) on "
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
    write_json(js, report)
    update_section(md, f"load{a.tag}", text)
    print(f"\nwrote {js} and the load section of {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
