"""The engine core's own ceiling: one-pair score requests/s that one engine core serves when the fronts are
never the limit, and its CPU per request as the requests a frame grow.

`bench/fronts.py` measures the core behind two real fronts on a 2-vCPU machine, where the fronts, wrk and the
model processes take most of the CPU and 64 clients give the core ~12 requests a frame. A 16-core host with
15 fronts gives it more requests at once and larger frames. This benchmark stands in for those fronts: it
starts `qtrel serve --http-workers 2` (tiny random BERT, cache off, as fronts.py), connects to the core's
Unix socket as further fronts do (`service.runtime.wire`, the fronts' own frames), and keeps `--outstanding`
one-pair requests in flight on each of `--links` connections, each with a distinct title and token ids a real
tokeniser made. It sends the requests of one event-loop turn as one frame, as a front does; what a frame holds
then follows from the load. The real fronts stay idle.

Per setting: requests/s, the core's CPU per request and its busy share (CPU seconds over wall seconds: near 1.0
the core's one core is the limit, and requests/s is its ceiling), the model processes' and this driver's CPU per
request, requests per frame and pairs per batch (the server's qtrel_batch_pairs).

    python bench/core_ceiling.py --quick                         # one short setting (< 40 s)
    python bench/core_ceiling.py --outstanding 8,32,128 --rounds 2 --seconds 8
    python bench/core_ceiling.py --links 15 --outstanding 2,8,32 --against /tmp/base   # 15 stand-in fronts, 2 builds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from fronts import ROOT, processes, start_server, stat, tiny_checkpoint, wait_ready
from harness.live import free_port
from harness.server import metrics_of

from model.tokenizer import PairTokenizer, pack_pair
from service.runtime.wire import Channel

QUERY = "cordless drill"


class Driver:
    """One connection to the core, as a front: keeps `outstanding` requests in flight."""

    def __init__(self, pool: list[tuple[bytes, bytes, bool]], outstanding: int, start: int):
        self.pool, self.outstanding, self.n = pool, outstanding, start
        self.channel = Channel(self.on_frame)
        self.state: asyncio.Future = asyncio.get_running_loop().create_future()
        self.generation = 0
        self.done = self.errors = self.frames = 0
        self.errors_seen: dict[str, int] = {}
        self.running = True

    def on_frame(self, frame: tuple) -> None:
        op = frame[0]
        if op == "done":
            self.frames += 1
            for _rid, ok, value in frame[2]:
                self.done += 1
                if not ok:
                    self.errors += 1
                    self.errors_seen[value[0]] = self.errors_seen.get(value[0], 0) + 1
                if self.running:
                    self.send()
        elif op == "state" and not self.state.done():
            self.generation = frame[2]["models"][0]["generation"]
            self.state.set_result(None)
        elif op == "collect":  # the core's metrics collection: this driver has no samples of its own
            self.channel.send(("collected", frame[1], []))

    def send(self) -> None:
        self.n += 1
        ids, segs, cut = self.pool[self.n % len(self.pool)]
        args: dict[str, object] = {
            "model": None,
            "generation": self.generation,
            "truncation": "only_second",
            "side": "right",
            "timeout_ms": None,
            "allow_truncation": True,
            "use_cache": True,
            "priority": "high",
            "queries": [QUERY],
            "titles": [f"drill kit number {self.n}"],  # distinct: no single flight folds two requests
            "ids": [ids],
            "segs": [segs],
            "cut": [cut],
            "unk": [0.0],
            "rid": "",
            "tp": {},
        }
        self.channel.send_item("scores", (self.n, args))

    async def connect(self, path: str) -> None:
        await asyncio.get_running_loop().create_unix_connection(lambda: self.channel, path)
        self.channel.send(("hello", 0, os.getpid()))
        await asyncio.wait_for(self.state, 10)
        for _ in range(self.outstanding):
            self.send()


def batch_pairs(url: str) -> tuple[float, float]:
    """(sum, count) of the server's qtrel_batch_pairs histogram."""
    m = metrics_of(urllib.request.urlopen(url + "/metrics", timeout=10).read().decode())
    return m.get("qtrel_batch_pairs_sum", 0.0), m.get("qtrel_batch_pairs_count", 0.0)


async def measure(path: str, url: str, roles: dict, pool: list, links: int, outstanding: int, seconds: float) -> dict:
    drivers = [Driver(pool, outstanding, start=i * 10**9 + int(time.time() * 1000) % 10**8) for i in range(links)]
    for d in drivers:
        await d.connect(path)
    await asyncio.sleep(1.5)  # warm: batches at this load, the allocator
    pids = [p for ps in roles.values() for p in ps]
    before_cpu = {p: stat(p)[1] for p in pids}
    before_self = resource.getrusage(resource.RUSAGE_SELF)
    before_batches = await asyncio.to_thread(batch_pairs, url)
    before = [(d.done, d.errors, d.frames) for d in drivers]
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    wall = time.monotonic() - t0
    after = [(d.done, d.errors, d.frames) for d in drivers]
    spent = {p: stat(p)[1] - t for p, t in before_cpu.items()}
    after_self = resource.getrusage(resource.RUSAGE_SELF)
    after_batches = await asyncio.to_thread(batch_pairs, url)
    for d in drivers:  # let the requests in flight land, then hang up
        d.running = False
    await asyncio.sleep(0.5)
    for d in drivers:
        d.channel.close()
    n = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    errors = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    frames = sum(a[2] - b[2] for a, b in zip(after, before, strict=True))
    if n == 0:
        raise RuntimeError("no request finished in the window")
    core_s = spent[roles["core"][0]]
    me = (after_self.ru_utime + after_self.ru_stime) - (before_self.ru_utime + before_self.ru_stime)
    batches = after_batches[1] - before_batches[1]
    seen: dict[str, int] = {}
    for d in drivers:
        for k, v in d.errors_seen.items():
            seen[k] = seen.get(k, 0) + v
    return {
        "links": links,
        "outstanding": outstanding,
        "rps": n / wall,
        "errors": errors,
        "errors_seen": seen,
        "core_us": core_s / n * 1e6,
        "core_busy": core_s / wall,
        "model_us": sum(spent[p] for p in roles["model"]) / n * 1e6,
        "fronts_us": sum(spent[p] for p in roles["fronts"]) / n * 1e6,
        "driver_us": me / n * 1e6,
        "requests_per_frame": n / max(1, frames),
        "pairs_per_batch": (after_batches[0] - before_batches[0]) / batches if batches else None,
        "loadavg": round(os.getloadavg()[0], 2),
    }


def token_pool(model: Path, size: int = 512) -> list[tuple[bytes, bytes, bool]]:
    tok = PairTokenizer.from_dir(model)
    enc = tok.encode([QUERY] * size, [f"drill kit number {i}" for i in range(size)])
    return [(*pack_pair(i, s), c) for i, s, c in zip(enc.input_ids, enc.token_type_ids, enc.truncated, strict=True)]


async def serve_and_measure(
    a: argparse.Namespace, model: Path, work: Path, root: Path, settings: list[int]
) -> list[dict]:
    """One server of the checkout at `root`, each setting measured on it in turn."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sockets = work / f"sockets-{port}"
    sockets.mkdir()
    os.environ["TMPDIR"] = str(sockets)  # the core's socket folder (tempfile.mkdtemp) lands here, where we find it
    proc = start_server(model, 2, "reuseport", port, work / "server.log", root)
    os.environ.pop("TMPDIR")
    runs = []
    try:
        await asyncio.to_thread(wait_ready, url, proc)
        path = str(next(sockets.glob("qtrel-core-*/core.sock")))
        roles = processes(proc.pid)
        pool = token_pool(model)
        for outstanding in settings:
            r = await measure(path, url, roles, pool, a.links, outstanding, a.seconds) | {"root": str(root)}
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
            runs.append(r)
    finally:
        proc.terminate()
        proc.wait(60)
    return runs


async def run(a: argparse.Namespace, model: Path, work: Path) -> list[dict]:
    settings = [int(x) for x in a.outstanding.split(",")]
    roots = [ROOT] + ([a.against.resolve()] if a.against else [])
    runs = []
    for i in range(a.rounds):  # the order of settings and of checkouts alternates by round
        for root in roots if i % 2 == 0 else roots[::-1]:
            got = await serve_and_measure(a, model, work, root, settings if i % 2 == 0 else settings[::-1])
            runs += [r | {"round": i} for r in got]
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round of one setting, 3 s")
    ap.add_argument("--links", type=int, default=2, help="connections to the core (stand-in fronts)")
    ap.add_argument("--outstanding", default="8,32,128", help="requests in flight per connection, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--out", type=Path, help="write the raw runs and summary as JSON here")
    ap.add_argument("--against", type=Path, help="another checkout (C kernels built): each round runs both")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.outstanding = 1, 3.0, "32"
    work = Path(tempfile.mkdtemp(prefix="qtrel-core-ceiling-"))
    model = tiny_checkpoint(Path(tempfile.gettempdir()) / "qtrel-fronts-tiny-bert")
    try:
        import uvloop

        runs = uvloop.run(run(a, model, work))
    except ImportError:
        runs = asyncio.run(run(a, model, work))
    summary: dict[str, dict] = {}
    for root in sorted({r["root"] for r in runs}):
        for o in sorted({r["outstanding"] for r in runs}):
            rs = [r for r in runs if r["outstanding"] == o and r["root"] == root]
            keys = ("rps", "core_us", "core_busy", "model_us", "driver_us", "requests_per_frame", "pairs_per_batch")
            row = {k: statistics.median(r[k] for r in rs) for k in keys if all(r[k] is not None for r in rs)}
            name = f"{o * a.links} in flight" + ("" if root == str(ROOT) else f" @ {root}")
            summary[name] = row | {"errors": sum(r["errors"] for r in rs)}
    for k, row in summary.items():
        print(f"{k}:", json.dumps({x: round(v, 3) if isinstance(v, float) else v for x, v in row.items()}))
    print("ceiling of the core = requests/s where core_busy is near 1.0; else ~ 1 / core CPU per request")
    if a.out:
        a.out.write_text(json.dumps({"runs": runs, "summary": summary, "root": str(ROOT)}, indent=1))
    return 0 if runs and all(r["errors"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
