"""Servers on loopback for the load benchmarks: `qtrel serve` (and the anchors) as subprocesses, started,
polled until ready and stopped; the port, the process tree and its CPU time, the Prometheus page."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from harness.publish import ROOT


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
    would measure its hits, not the forward path (lab/cache_replay.py measures the cache)."""
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
