"""Interleaved timing: every system and probe once per repeat, the order rotated, other jobs optionally
paused for the timed part (SIGSTOP, SIGCONT after, whatever happens)."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from harness.passes import Pass


class Pause:
    """SIGSTOP processes for the timed part of one repeat and SIGCONT it after, whatever happens; never
    for more than `limit` seconds at a stretch (`tick` between systems lets it run for a second)."""

    def __init__(self, pids: list[int] | None, limit: float = 600.0, match: str | None = None):
        self.given, self.match, self.limit, self.since = pids or [], match, limit, 0.0
        self.pids: list[int] = []

    def _resolve(self) -> None:  # `match`: whatever runs under that command line now (pgrep -f)
        found = []
        if self.match:
            out = subprocess.run(["pgrep", "-f", self.match], capture_output=True, text=True).stdout
            found = [int(x) for x in out.split() if int(x) != os.getpid()]
        self.pids = self.given + found

    def _send(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def __enter__(self):
        self._resolve()
        self._send(signal.SIGSTOP)
        self.since = time.monotonic()
        return self

    def tick(self) -> None:
        if self.pids and time.monotonic() - self.since > self.limit:
            self._send(signal.SIGCONT)
            time.sleep(1.0)
            self._resolve()
            self._send(signal.SIGSTOP)
            self.since = time.monotonic()

    def __exit__(self, *exc):
        self._send(signal.SIGCONT)


def measure(systems: dict[str, Pass], probes: dict[str, Callable[[], float]], repeats: int, pause: Pause):
    """Seconds (wall and this process's CPU) per pass of each system, probes beside them, interleaved,
    after one warm-up pass per system (every shape once) that also gives the logits."""
    runs: dict[str, dict[str, Any]] = {}
    for name, fn in systems.items():
        t0 = time.perf_counter()
        runs[name] = {"logits": fn(), "seconds": [], "cpu_seconds": [], "warmup_s": time.perf_counter() - t0}
        print(f"  warm-up {name}: {runs[name]['warmup_s']:.1f}s", flush=True)
    probe_runs: dict[str, list[float]] = {p: [] for p in probes}
    load: list[dict] = []
    names = list(systems) + list(probes)
    for r in range(repeats):
        t_rep = time.perf_counter()
        with pause as pz:
            for name in names[r % len(names) :] + names[: r % len(names)]:
                pz.tick()
                if name in probes:
                    probe_runs[name].append(probes[name]())
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                systems[name]()
                runs[name]["seconds"].append(time.perf_counter() - t0)
                runs[name]["cpu_seconds"].append(time.process_time() - c0)
        load.append({"loadavg_1min_after": os.getloadavg()[0], "repeat_s": round(time.perf_counter() - t_rep, 1)})
        print(
            f"  repeat {r + 1}/{repeats} ({load[-1]['repeat_s']}s, load {load[-1]['loadavg_1min_after']:.1f}): "
            + ", ".join(f"{n} {runs[n]['seconds'][-1]:.2f}s" for n in systems)
            + "; probes "
            + ", ".join(f"{p} {v[-1]:.0f} GFLOP/s" for p, v in probe_runs.items()),
            flush=True,
        )
    return runs, probe_runs, load


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": [round(x, 2) for x in xs]}
