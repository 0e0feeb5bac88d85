"""Deployment tests: external tools found on PATH or in the virtual environment, and a real
`qtrel serve` process on loopback (the way the image runs it), on the tiny checkpoint."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import fronts_env

VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """Path of an external tool (pip-installed ones live beside this Python); skip the test without it."""
    found = shutil.which(name, path=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]))
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, status: int = 200) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == status:
                return
            last = r.status_code
        except httpx.TransportError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer {status} in {timeout}s (last: {last})")


class QtrelProcess:
    """`qtrel serve` as a child process, configured only through QTREL_* variables, as in the image."""

    def __init__(self, model_dir: Path, log_path: Path, **settings: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("QTREL_")}
        env.update(
            {
                "QTREL_MODEL": str(model_dir),
                "QTREL_HOST": "127.0.0.1",
                "QTREL_PORT": str(self.port),
                "QTREL_THREADS": "1",
                "QTREL_LOG_JSON": "false",
                **fronts_env(),
            }
        )
        env.update({f"QTREL_{k.upper()}": str(v) for k, v in settings.items()})
        qtrel = shutil.which("qtrel", path=str(VENV_BIN))
        cmd = [qtrel, "serve"] if qtrel else [sys.executable, "-m", "service.cli", "serve"]
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.started = time.monotonic()

    def wait_ready(self, timeout: float = 120) -> float:
        try:
            wait_http(self.url + "/health/ready", timeout, self.proc)
        except (RuntimeError, TimeoutError) as e:
            raise RuntimeError(f"{e}\n--- qtrel log ---\n{self.log()}") from None
        return time.monotonic() - self.started

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, as a container runtime sends it; the exit status once the process has drained."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def service_or_skip() -> None:
    try:
        import service.app  # noqa: F401
        import service.cli  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the service is not importable yet: {e}")


@pytest.fixture(scope="module")
def qtrel_serve(tiny_checkpoint, tmp_path_factory):
    service_or_skip()
    # with a shadow (the same checkpoint), so that the shadow metrics the dashboard shows are served too
    proc = QtrelProcess(
        tiny_checkpoint, tmp_path_factory.mktemp("qtrel") / "serve.log", shadow=f"cand={tiny_checkpoint}"
    )
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.terminate()
