"""Model processes forked from the fork server's template: they run the real model, share its pages, and
never take a template that is not theirs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from multiprocessing import forkserver
from pathlib import Path

import pytest

from service.runtime.workers import backend_process, template
from service.runtime.workers.backend import LoadSpec
from service.runtime.workers.backend_process import start_context

ROOT = Path(__file__).resolve().parents[4]

# In a fresh interpreter: the fork server is one per process, and its template is the first spec it serves.
PROBE = r"""
import json, os, sys
from service.runtime.workers.backend import LoadSpec
from model.levels import unpack_rows
from service.runtime.workers.runner import load_model, forward_batch
from tests.service.runtime.workers.hooked import HookedProcessBackend

def memory(pid):
    d = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        p = line.split()
        if len(p) >= 2 and p[1].isdigit():
            d[p[0].rstrip(":")] = int(p[1])
    return {"rss": d["Rss"], "private": d["Private_Clean"] + d["Private_Dirty"]}

if __name__ == "__main__":
    spec = LoadSpec(sys.argv[1], threads=1, inference=sys.argv[2])
    backends = [HookedProcessBackend(spec) for _ in range(2)]  # the production backend, with a "state" job
    batch = [([101, 2023, 2003, 102], [0, 0, 0, 0]), ([101, 7592, 102, 2088, 102], [0, 0, 0, 1, 1])]
    inference, probes = [], []
    try:
        for b in backends:
            info = b.load()
            inference.append(info["inference"])
            probes.append(info["inference_probe"])
            b.warm_up()
        scores = [[o.expected for o in unpack_rows(b.forward(batch)[0], 2)] for b in backends]  # (rows, seconds)
        server = [int(open(f"/proc/{b.pid}/stat").read().rsplit(")", 1)[1].split()[1]) for b in backends]
        out = {
            "scores": scores,
            "want": [o.expected for o in unpack_rows(forward_batch(load_model(spec), batch)[0], 2)],
            "states": [b.job("state") for b in backends],
            "parents": server,
            "me": os.getpid(),
            "parent_threads": [len(os.listdir(f"/proc/{p}/task")) for p in server],
            "parent_openvino": [any("openvino" in line for line in open(f"/proc/{p}/maps")) for p in server],
            "inference": inference,
            "probes": probes,
            "child_openvino": [any("openvino" in line for line in open(f"/proc/{b.pid}/maps")) for b in backends],
            "children": [memory(b.pid) for b in backends],
        }
    finally:
        for b in backends:
            b.close()
    print(json.dumps(out))
"""


def forked(checkpoint: Path, tmp_path: Path, inference: str) -> dict:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(probe), str(checkpoint), inference]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_model_processes_are_forked_from_one_warm_template_and_share_it(tiny_checkpoint, tmp_path):
    out = forked(tiny_checkpoint, tmp_path, "torch")
    for got in out["scores"]:  # the real model, in each process
        assert got == out["want"]
    assert out["states"] == [{"template": True, "warmed": True, "threads": 1}] * 2
    fork_server = out["parents"][0]
    assert out["parents"] == [fork_server] * 2 and fork_server != out["me"]  # not forked from the server
    assert out["parent_threads"] == [1, 1]  # the fork server forks with no other thread alive
    assert out["inference"] == ["torch"] * 2 and out["parent_openvino"] == [False, False]
    for child in out["children"]:  # torch and the model are the template's pages, not the child's own
        assert child["private"] < 0.25 * child["rss"], child


def test_openvino_is_compiled_in_each_forked_model_process_never_in_the_template(tiny_checkpoint, tmp_path):
    pytest.importorskip("openvino")
    out = forked(tiny_checkpoint, tmp_path, "openvino")
    assert out["inference"] == ["openvino"] * 2  # each model process compiled its own, after the fork
    for got in out["scores"]:  # float32 OpenVINO: the torch path's scores to rounding
        assert got == pytest.approx(out["want"], abs=1e-5)
    assert out["states"] == [{"template": True, "warmed": True, "threads": 1}] * 2  # torch's pages still shared
    assert out["parent_threads"] == [1, 1]  # the template still forks with one thread...
    assert out["parent_openvino"] == [False, False]  # ...and never loaded OpenVINO at all


def test_an_auto_probe_that_keeps_torch_leaves_no_openvino_in_the_serving_process(tiny_checkpoint, tmp_path):
    """`auto`: the first model process times OpenVINO against torch. Where torch wins, the process that probed
    is replaced by a fresh one with the choice pinned, so that OpenVINO's libraries and pools (~140 MB on a
    Zen 4) are not kept for nothing; the probe's figures still reach /info."""
    pytest.importorskip("openvino")
    out = forked(tiny_checkpoint, tmp_path, "auto")
    # two bare backends, no worker to pin the first one's choice for the second: each probes
    assert all(p is not None and set(p) == {"torch_ms", "openvino_ms"} for p in out["probes"])
    for chosen, has_openvino in zip(out["inference"], out["child_openvino"]):
        assert has_openvino is (chosen == "openvino")  # where OpenVINO won the probe here, it serves
    assert out["parent_openvino"] == [False, False]


def test_a_template_serves_only_its_own_spec_as_it_is_on_disk(tiny_checkpoint, monkeypatch):
    spec = LoadSpec(str(tiny_checkpoint), threads=1)
    t = template.Template(spec, template.weights_stamp(spec.model_dir), model=None, warmed=True, default_threads=2)  # type: ignore[arg-type]
    monkeypatch.setattr(template, "TEMPLATE", t)
    assert template.take(spec) is t
    assert template.take(dataclasses.replace(spec, dtype="bfloat16")) is None
    assert template.take(dataclasses.replace(spec, attention="torch")) is None
    weights = tiny_checkpoint / "model.safetensors"
    stat = weights.stat()
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # rewritten in place
        assert template.take(spec) is None
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    other = dataclasses.replace(spec, dtype="bfloat16", inference="auto", max_batch_tokens=1024)
    assert template.decode(json.dumps(dataclasses.asdict(other))) == other  # as the fork server reads it


def test_cuda_process_start_spawn_and_no_fork_server_spawn_a_process(tiny_checkpoint, monkeypatch):
    spec = LoadSpec(str(tiny_checkpoint))
    assert start_context(dataclasses.replace(spec, device="cuda")).get_start_method() == "spawn"
    assert start_context(dataclasses.replace(spec, start="spawn")).get_start_method() == "spawn"

    def no_socket():
        raise PermissionError("read-only /tmp")

    monkeypatch.setattr(forkserver, "ensure_running", no_socket)
    assert start_context(spec).get_start_method() == "spawn"
    assert backend_process.TEMPLATE_ENV not in os.environ
