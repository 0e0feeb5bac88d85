"""Every metric the dashboard, the alerts, the Prometheus adapter and the HPA use is one qtrel exports,
with labels it has: against the documented list, and against a live /metrics."""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.deployfiles import (
    SPEC_METRICS,
    adapter_queries,
    alert_queries,
    dashboard_queries,
    dashboard_variable_queries,
    hpa_custom_metrics,
    label_problems,
    live_metric_names,
    metrics_used,
    spec_sample_names,
)


def _used() -> dict[str, set[str]]:
    return {
        "dashboard": metrics_used(dashboard_queries()) | metrics_used(dashboard_variable_queries()),
        "alerts": metrics_used(alert_queries()),
        "adapter": metrics_used(adapter_queries()),
        "hpa": hpa_custom_metrics(),
    }


def test_the_files_use_the_metrics_they_are_about():
    used = _used()
    # Not an empty pass: the dashboard covers every specified metric, the alerts the key ones.
    assert {m.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") for m in used["dashboard"]} >= set(
        SPEC_METRICS
    )
    assert {
        "qtrel_ready",
        "qtrel_requests_total",
        "qtrel_request_duration_seconds_bucket",
        "qtrel_queue_depth",
    } <= used["alerts"]
    assert used["hpa"] == {"qtrel_pairs_in_flight"} and used["hpa"] <= used["adapter"]


@pytest.mark.parametrize("where", ["dashboard", "alerts", "adapter", "hpa"])
def test_used_metrics_are_in_the_documented_list(where):
    unknown = _used()[where] - spec_sample_names()
    assert not unknown, f"{where} uses metrics qtrel does not document: {sorted(unknown)}"


def test_used_labels_exist_on_their_metrics():
    queries = {f"dashboard {k}": v for k, v in dashboard_queries().items()}
    queries |= {f"alert {k}": v for k, v in alert_queries().items()}
    queries |= {f"adapter {k}": v for k, v in adapter_queries().items()}
    assert label_problems(queries) == []


def test_label_check_catches_mistakes():
    bad = {
        "a": 'sum by (code) (rate(qtrel_requests_total{path="/score"}[5m]))',
        "b": 'qtrel_queue_seconds_bucket{le="0.1", route="/score"}',
    }
    assert len(label_problems(bad)) == 3


@pytest.mark.slow
@pytest.mark.parametrize("where", ["dashboard", "alerts", "adapter", "hpa"])
def test_used_metrics_are_served_by_a_live_qtrel(qtrel_serve, where):
    live = live_metric_names(qtrel_serve.url)
    unknown = _used()[where] - live
    assert not unknown, f"{where} uses metrics a live qtrel does not serve: {sorted(unknown)}"


@pytest.mark.slow
def test_live_metrics_include_the_documented_list(qtrel_serve):
    missing = spec_sample_names() - live_metric_names(qtrel_serve.url)
    assert not missing, f"documented but not served: {sorted(missing)}"


@pytest.mark.slow
def test_alert_label_values_match_the_live_service(qtrel_serve):
    """The alerts and the dashboard select route="/score" and status codes as strings: check that a
    scored request shows up under exactly those label values."""
    r = httpx.post(qtrel_serve.url + "/score", json={"query": "drill", "titles": ["cordless drill"]}, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.get(qtrel_serve.url + "/metrics", timeout=10).text
    lines = text.splitlines()
    assert any(line.startswith('qtrel_requests_total{route="/score",status="200"}') for line in lines)
    assert any(line.startswith("qtrel_request_duration_seconds_bucket{") and 'route="/score"' in line for line in lines)
