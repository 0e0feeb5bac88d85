"""The real Prometheus server (Debian's `prometheus` package) scrapes a real `qtrel serve` on loopback
with the project's alert rules loaded; qtrel's metrics, the alert rules and every dashboard query
are then read back through Prometheus' HTTP API."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
import yaml

from tests.deploy.conftest import free_port, tool, wait_http
from tests.deploy.deployfiles import ALERTS, alert_queries, dashboard_queries

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prometheus(qtrel_serve, tmp_path_factory):
    binary = tool("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": "qtrel",
                "static_configs": [{"targets": [qtrel_serve.url.removeprefix("http://")]}],
            }
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    log = (work / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address={url.removeprefix('http://')}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(url + "/-/ready", 60, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def wait_for(prom: str, expr: str, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(prom, expr)
        if result:
            return result
        time.sleep(0.5)
    raise TimeoutError(f"no result for {expr} within {timeout}s")


def test_prometheus_scrapes_qtrel(prometheus, qtrel_serve):
    r = httpx.post(
        qtrel_serve.url + "/score",
        json={"query": "cordless drill", "titles": ["DEWALT 20V cordless drill", "garden hose"]},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    up = wait_for(prometheus, 'up{job="qtrel"} == 1')
    assert up[0]["metric"]["instance"] == qtrel_serve.url.removeprefix("http://")
    assert wait_for(prometheus, 'qtrel_ready{job="qtrel"} == 1')
    # The scored request, under the labels that the alerts and the dashboard select on.
    scored = wait_for(prometheus, 'qtrel_requests_total{job="qtrel", route="/score", status="200"} >= 1')
    assert float(scored[0]["value"][1]) >= 1
    assert float(wait_for(prometheus, "qtrel_pairs_total >= 2")[0]["value"][1]) >= 2
    info = wait_for(prometheus, "qtrel_model_info")[0]["metric"]
    assert info["device"] == "cpu" and info["model"]


def test_alert_rules_load_and_evaluate(prometheus, qtrel_serve):
    deadline = time.monotonic() + 60
    while True:
        rules = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = {r["name"]: r for g in rules for r in g["rules"]}
        if set(loaded) == set(alert_queries()) and all(r["health"] == "ok" for r in loaded.values()):
            break
        assert time.monotonic() < deadline, f"rules not all evaluated ok: {loaded}"
        time.sleep(0.5)
    # A healthy service: nothing fires.
    alerts = httpx.get(prometheus + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    assert [a for a in alerts if a["state"] == "firing"] == []


def test_every_dashboard_query_runs(prometheus, qtrel_serve):
    httpx.post(qtrel_serve.url + "/score", json={"query": "hammer", "titles": ["claw hammer"]}, timeout=30)
    wait_for(prometheus, "qtrel_pairs_total")
    empty = []
    for title, expr in dashboard_queries().items():
        if not query(prometheus, expr):
            empty.append(title)
    # Rates need two scrapes of a changed counter, and error panels need errors; but the panels that
    # show current state must have data at once.
    for title in ("Ready replicas [A]", "Model [A]", "Queue depth and pairs in flight [A]"):
        assert title not in empty, f"{title} has no data"
