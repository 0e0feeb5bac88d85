"""The front-bound ceiling: how many one-pair requests/s `qtrel serve` answers when the model costs nearly
nothing, with one HTTP process (`--http-workers 1`) and with two front processes before one engine core,
and what each process spends per request.

A tiny random BERT (2 layers, hidden 32, the built-in model's vocabulary) is written under /tmp, the cache
is off (QTREL_CACHE_MB=0: every request reaches the core's queue and a model process), and `wrk` drives
64 keep-alive connections posting one pair each, every title distinct. The layouts run in interleaved
rounds (the order alternating), each a fresh server. Per run: requests/s and latency from wrk, and from
/proc/PID/stat the CPU seconds per request of every front, of the engine core, of the model processes and
of wrk itself. The 16-core estimate is min((16 - 1) / front CPU per request, 1 / core CPU per request):
one core left to the core process, every other running a front, and the one core's own ceiling.

    python bench/fronts.py --quick                  # one short round of 1 and 2 fronts (< 60 s); needs wrk
    python bench/fronts.py --rounds 3 --seconds 10  # 1, 2 (reuseport) and 2 (shared socket), 3 rounds
    python bench/fronts.py --against /tmp/base      # 2 fronts of this build and of another checkout, interleaved
    python bench/fronts.py --hold 2                 # one server with 2 fronts kept for a profiler: its pids
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from harness.live import free_port

ROOT = Path(__file__).resolve().parent.parent
LUA = """
counter = 0
request = function()
  local titles = {}
  for i = 1, TITLES do
    counter = counter + 1
    titles[i] = '"drill kit number ' .. counter .. ' ' .. math.random(1e9) .. '"'
  end
  local body = '{"query": "cordless drill", "titles": [' .. table.concat(titles, ",") .. ']}'
  return wrk.format("POST", "/score", {["Content-Type"] = "application/json"}, body)
end
"""


def tiny_checkpoint(path: Path) -> Path:
    """A randomly initialised 2-layer BERT with the built-in model's tokenizer: its forward is ~free."""
    if (path / "model.safetensors").exists():
        return path
    from model.bert import BertForRelevance
    from model.builtin import builtin_dir
    from model.checkpoint import save_checkpoint
    from model.config import BertConfig
    from model.tokenizer import PairTokenizer

    tok = PairTokenizer.from_dir(builtin_dir())
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    module = BertForRelevance(cfg)
    module.init_weights(0, std=0.2)
    save_checkpoint(module, tok, path)
    return path


def stat(pid: int) -> tuple[int, float]:
    """(parent pid, CPU seconds) of a live process; (0, 0) once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0, 0.0
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def processes(root: int) -> dict[str, list[int]]:
    """The server's processes by role: core (the `qtrel serve` process), fronts, model (everything else)."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            parents[int(d.name)] = stat(int(d.name))[0]
    below, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        below += kids
        todo += kids
    roles: dict[str, list[int]] = {"core": [root], "fronts": [], "model": []}
    for pid in below:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        roles["fronts" if b"service.front" in cmd else "model"].append(pid)
    return roles


def pss_mb(pid: int) -> float:
    """Proportional set size (shared pages split among their users), MiB; 0 once gone."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health/ready", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server never became ready")


def run_wrk(url: str, lua: Path, seconds: float, connections: int) -> dict:
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds:.0f}s", "--timeout", "30s", "--latency", "-s", str(lua), url]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = p.stdout.read() if p.stdout else ""
    _, _, usage = os.wait4(p.pid, 0)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    lat = dict(re.findall(r"^\s+(50|99)%\s+([\d.]+\w+)", out, re.M))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    return {
        "rps": rps,
        "requests": total,
        "p50": lat.get("50"),
        "p99": lat.get("99"),
        "non2xx": int(errors.group(1)) if errors else 0,
        "wrk_cpu_s": usage.ru_utime + usage.ru_stime,
    }


def start_server(model: Path, workers: int, sock: str, port: int, log: Path, root: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "QTREL_CACHE_MB": "0", "QTREL_LOG_LEVEL": "warning", "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(model), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--http-workers", str(workers), "--http-socket", sock]
    if "qtrel-fronts-tiny-bert" in str(model):  # no OpenVINO probe for a model that costs nothing
        cmd += ["--inference", "torch"]
    with open(log, "a") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)


def hold(model: Path, workers: int, port: int, lua: Path, log: Path) -> int:
    """One server kept running for a profiler: its processes by role, and the wrk command that loads it."""
    proc = start_server(model, workers, "reuseport", port, log)
    url = f"http://127.0.0.1:{port}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the server is stopped with this script
    try:
        wait_ready(url, proc)
        print(json.dumps(processes(proc.pid)), flush=True)
        print(f"load: wrk -t1 -c64 -d30s -s {lua} {url}  (e.g. py-spy record -r 500 -p <core pid>); Ctrl-C stops")
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


def one_run(
    model: Path,
    workers: int,
    sock: str,
    port: int,
    seconds: float,
    lua: Path,
    log: Path,
    connections: int = 64,
    root: Path = ROOT,
) -> dict:
    proc = start_server(model, workers, sock, port, log, root)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        roles = processes(proc.pid)
        idle = {role: sum(pss_mb(p) for p in pids) for role, pids in roles.items()}
        run_wrk(url, lua, 2, connections)  # warm: connections, caches, the allocator
        before = {pid: stat(pid)[1] for pids in roles.values() for pid in pids}
        r = run_wrk(url, lua, seconds, connections)
        spent = {pid: stat(pid)[1] - t for pid, t in before.items()}
        n = r["requests"]
        if n == 0:
            raise RuntimeError("no request finished in the window: fewer --connections, or more --seconds")
        fronts = [spent[p] / n * 1e6 for p in roles["fronts"]]
        r |= {
            "workers": workers,
            "socket": sock if root == ROOT else f"{sock}@{root}",
            "core_us": spent[proc.pid] / n * 1e6,
            "fronts_us": fronts,
            "model_us": sum(spent[p] for p in roles["model"]) / n * 1e6,
            "wrk_us": r["wrk_cpu_s"] / n * 1e6,
            "idle_pss_mb": idle,
            "loadavg": round(os.getloadavg()[0], 2),  # the host's load after the run: name it beside the figures
        }
        return r
    finally:
        proc.terminate()
        proc.wait(60)


def summarise(runs: list[dict], cores: int = 16) -> dict:
    out = {}
    for key in sorted({(r["workers"], r["socket"]) for r in runs}):
        rs = [r for r in runs if (r["workers"], r["socket"]) == key]
        front = statistics.median(sum(r["fronts_us"]) for r in rs) if key[0] > 1 else None
        core = statistics.median(r["core_us"] for r in rs)
        row = {
            "rps": statistics.median(r["rps"] for r in rs),
            "core_us": core,
            "fronts_us": front,
            "model_us": statistics.median(r["model_us"] for r in rs),
            "wrk_us": statistics.median(r["wrk_us"] for r in rs),
            "idle_pss_mb": statistics.median(sum(r["idle_pss_mb"].values()) for r in rs),
            "front_balance": statistics.median(max(r["fronts_us"]) / max(1e-9, min(r["fronts_us"])) for r in rs)
            if key[0] > 1
            else None,
        }
        if front:
            row["core_share_of_front"] = core / front  # the core's CPU for a request against its front's
            row["estimate_16_cores"] = min((cores - 1) / (front * 1e-6), 1 / (core * 1e-6))
        out[f"{key[0]}x{key[1]}"] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one round of 1 and 2 fronts, 4 s each")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--port", type=int, help="the servers' port (default: a free one each run)")
    ap.add_argument("--no-shared", action="store_true", help="leave out the shared-socket runs")
    ap.add_argument("--model", type=Path, help="serve this checkpoint (builtin: model/default) instead of a tiny one")
    ap.add_argument("--connections", type=int, default=64, help="wrk's keep-alive connections (clients)")
    ap.add_argument("--titles", type=int, default=1, help="distinct titles a request (default 1: one pair)")
    ap.add_argument("--out", type=Path, default=None, help="write the raw runs and summary as JSON here")
    ap.add_argument("--against", type=Path, help="another checkout (C kernels built): 2 fronts of each, interleaved")
    ap.add_argument("--hold", type=int, metavar="N", help="start one server with N fronts, print its pids, keep it")
    a = ap.parse_args()
    rounds, seconds = (1, 4.0) if a.quick else (a.rounds, a.seconds)
    layouts = [(1, "reuseport", ROOT), (2, "reuseport", ROOT)]
    layouts += [] if a.quick or a.no_shared else [(2, "shared", ROOT)]
    if a.against:
        layouts = [(2, "reuseport", ROOT), (2, "reuseport", a.against.resolve())]
    work = Path(tempfile.mkdtemp(prefix="qtrel-fronts-bench-"))
    model = a.model.resolve() if a.model else tiny_checkpoint(Path(tempfile.gettempdir()) / "qtrel-fronts-tiny-bert")
    lua = work / "distinct.lua"
    lua.write_text(LUA.replace("TITLES", str(a.titles)))
    if a.hold:
        return hold(model, a.hold, a.port or free_port(), lua, work / "server.log")
    runs = []
    for i in range(rounds):
        order = layouts if i % 2 == 0 else layouts[::-1]
        for w, sock, root in order:
            port = a.port or free_port()  # a fixed one could be another server's (SO_REUSEPORT would share it)
            r = one_run(model, w, sock, port, seconds, lua, work / "server.log", a.connections, root) | {"round": i}
            print(json.dumps({k: v for k, v in r.items() if k != "wrk_cpu_s"}), flush=True)
            runs.append(r)
    summary = summarise(runs)
    for name, row in summary.items():  # requests/s against one process in the same round: median of rounds
        w, sock = name.split("x", 1)
        pairs = [
            (r["rps"], b["rps"])
            for r in runs
            for b in runs
            if (r["workers"], r["socket"]) == (int(w), sock) and b["workers"] == 1 and b["round"] == r["round"]
        ]
        row["vs_1"] = statistics.median(x / y for x, y in pairs) if pairs else None
        print(name, json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
    print(f"pairs/s = requests/s x {a.titles}; CPU figures are per request")
    if a.out:
        a.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
