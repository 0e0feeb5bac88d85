"""The CPU floor of the HTTP layer alone: a FastAPI endpoint that validates the same one-pair /score
body as qtrel and answers a fixed result without any model, served by uvicorn (uvloop, httptools) and
driven by bench/load.py's client with 64 one-pair clients. Prints requests/s and the CPU milliseconds
per request of the server and of the client: what no Python service on FastAPI can go below on this
machine, whatever its model.

  python lab/http_floor.py
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel


class Pair(BaseModel):
    query: str
    title: str


class Body(BaseModel):
    pairs: list[Pair]
    return_probs: bool = True


app = FastAPI()


@app.post("/score")
async def score(body: Body):
    return {
        "model": "none",
        "results": [
            {"index": i, "level": "3", "score": 3.0, "tokens": 0, "truncated": False} for i, _ in enumerate(body.pairs)
        ],
    }


@app.get("/health/ready")
async def ready():
    return {"status": "ready"}


def main() -> int:
    from load import Server, free_port, one_pair_bodies, read_dev, scenario

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--clients", type=int, default=64)
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "http_floor:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--app-dir",
        str(Path(__file__).parent),
    ]
    bodies, _ = one_pair_bodies(read_dev(), 4000)
    with tempfile.TemporaryDirectory() as tmp, Server(cmd, url, "/health/ready", Path(tmp) / "log", 60) as srv:
        o = asyncio.run(
            scenario(
                f"HTTP floor, {a.clients} clients x 1 pair",
                url,
                bodies,
                a,
                srv.proc.pid,
                clients=a.clients,
                metrics=False,
            )
        )
    rps = o["requests_per_s"]
    print(
        f"{rps:.0f} requests/s; CPU per request: server {1000 * o['server_cores'] / rps:.3f} ms, "
        f"client {1000 * o['client_cores'] / rps:.3f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
