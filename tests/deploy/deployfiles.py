"""What the deployment files ask of the service: metric names, label names, PromQL, settings.

Used by the tests in this folder and by docker/verify-static.sh:

    python -m tests.deploy.deployfiles dashboard-rules OUT.yml   # dashboard queries as a rules file
    python -m tests.deploy.deployfiles k8s-scrape-static OUT.yml # in-cluster scrape config, static target
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "qtrel.json"
ALERTS = DOCKER / "prometheus" / "alerts.yml"
ALERT_TESTS = DOCKER / "prometheus" / "alerts_test.yml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
K8S = DOCKER / "k8s"
K8S_SCRAPE = K8S / "monitoring" / "prometheus-scrape.yml"
ADAPTER = K8S / "monitoring" / "prometheus-adapter-config.yaml"
KUSTOMIZATIONS = [K8S, K8S / "gpu", K8S / "monitoring"]
COMPOSE = [DOCKER / "compose.yaml", DOCKER / "compose.gpu.yaml"]

# The service's metrics as specified (docs/deployment.md): name -> (type, label names).
# Counters are listed with their exposed `_total` name; histograms by their base name.
SPEC_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "qtrel_requests_total": ("counter", frozenset({"route", "status"})),
    "qtrel_rejected_total": ("counter", frozenset({"reason"})),
    "qtrel_predicted_level_total": ("counter", frozenset({"model", "level"})),
    "qtrel_pairs_total": ("counter", frozenset({"model"})),
    "qtrel_request_duration_seconds": ("histogram", frozenset({"route"})),
    "qtrel_queue_seconds": ("histogram", frozenset({"model"})),
    "qtrel_tokenize_seconds": ("histogram", frozenset()),
    "qtrel_inference_seconds": ("histogram", frozenset({"model"})),
    "qtrel_batch_pairs": ("histogram", frozenset({"model"})),
    "qtrel_batch_tokens": ("histogram", frozenset({"model"})),
    "qtrel_batch_padding_ratio": ("histogram", frozenset({"model"})),
    "qtrel_queue_depth": ("gauge", frozenset()),
    "qtrel_jobs": ("gauge", frozenset({"state"})),
    "qtrel_job_pairs_total": ("counter", frozenset()),
    "qtrel_job_queue_pairs": ("gauge", frozenset()),
    "qtrel_pairs_in_flight": ("gauge", frozenset()),
    "qtrel_ready": ("gauge", frozenset()),
    "qtrel_model_info": ("gauge", frozenset({"model", "device", "dtype", "version"})),
    "qtrel_worker_restarts_total": ("counter", frozenset({"model", "reason"})),
    "qtrel_batches_retried_total": ("counter", frozenset({"model"})),
    "qtrel_batches_failed_total": ("counter", frozenset({"model", "reason"})),
    "qtrel_batches_split_total": ("counter", frozenset({"model", "reason"})),
    "qtrel_cache_hits_total": ("counter", frozenset()),
    "qtrel_cache_misses_total": ("counter", frozenset()),
    "qtrel_cache_evictions_total": ("counter", frozenset()),
    "qtrel_cache_bytes": ("gauge", frozenset()),
    "qtrel_cache_entries": ("gauge", frozenset()),
    "qtrel_duplicates_folded_total": ("counter", frozenset({"where"})),
    "qtrel_dropped_pairs_total": ("counter", frozenset({"model", "reason"})),
    "qtrel_model_reloads_total": ("counter", frozenset({"model", "result"})),
    "qtrel_model_generation": ("gauge", frozenset({"model"})),
    "qtrel_shadow_pairs_total": ("counter", frozenset({"model", "level"})),
    "qtrel_shadow_agreed_total": ("counter", frozenset({"model", "level"})),
    "qtrel_shadow_score_diff": ("histogram", frozenset({"model", "level"})),
    "qtrel_shadow_score_abs_diff_total": ("counter", frozenset({"model", "level"})),
    "qtrel_shadow_dropped_total": ("counter", frozenset({"model", "reason"})),
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels that Prometheus adds at scrape time (job, instance) or the in-cluster relabelling adds.
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod"})

# Grafana's variables, replaced by values Prometheus accepts.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h", "$instance": ".*"}

_METRIC = re.compile(r"\b(qtrel_[a-z0-9_]+)\b")
_SELECTOR = re.compile(r"\b(qtrel_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def spec_sample_names() -> set[str]:
    """Every series name the specified metrics expose (histograms as _bucket, _sum and _count)."""
    names = set()
    for name, (kind, _) in SPEC_METRICS.items():
        names |= {name + s for s in HISTOGRAM_SUFFIXES} if kind == "histogram" else {name}
    return names


def base_metric(sample: str) -> str:
    """qtrel_batch_pairs_bucket -> qtrel_batch_pairs (for histograms; other names unchanged)."""
    for s in HISTOGRAM_SUFFIXES:
        if sample.endswith(s) and SPEC_METRICS.get(sample[: -len(s)], ("",))[0] == "histogram":
            return sample[: -len(s)]
    return sample


def sample_names_from_exposition(text: str) -> set[str]:
    """Series names that a Prometheus text exposition declares, whether or not a series has a value yet
    (a labelled counter has no sample until its first increment, but its # TYPE line is there)."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names |= {family.name + s for s in HISTOGRAM_SUFFIXES}
        else:
            names.add(family.name)
        names |= {s.name for s in family.samples}
    return names


def live_metric_names(base_url: str) -> set[str]:
    """Series names that a running qtrel serves on /metrics."""
    import httpx

    r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10)
    r.raise_for_status()
    return sample_names_from_exposition(r.text)


def grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def dashboard_queries() -> dict[str, str]:
    """Panel title (with refId) -> PromQL, Grafana variables replaced."""
    dash = json.loads(DASHBOARD.read_text())
    out = {}
    panels = list(dash["panels"])
    while panels:
        p = panels.pop(0)
        panels.extend(p.get("panels", []))  # panels inside collapsed rows
        for t in p.get("targets", []):
            out[f"{p['title']} [{t['refId']}]"] = grafana_to_promql(t["expr"])
    return out


def dashboard_variable_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def alert_queries() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {r.get("alert") or r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def adapter_queries() -> dict[str, str]:
    """The Prometheus adapter's series queries (they name the series the HPA reads)."""
    cm = yaml.safe_load(ADAPTER.read_text())
    rules = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    return {r["name"]["as"]: r["seriesQuery"] for r in rules}


def hpa_custom_metrics() -> set[str]:
    names = set()
    for path in K8S.rglob("hpa*.yaml"):
        for m in yaml.safe_load(path.read_text()).get("spec", {}).get("metrics", []):
            if m["type"] == "Pods":
                names.add(m["pods"]["metric"]["name"])
    return names


def metrics_used(queries: dict[str, str] | list[str]) -> set[str]:
    texts = queries.values() if isinstance(queries, dict) else queries
    return {m for q in texts for m in _METRIC.findall(q)}


def label_problems(queries: dict[str, str]) -> list[str]:
    """Label names a query uses that its qtrel metrics do not have: in selectors, per metric, and in
    by()/on() groupings, against the labels of every metric the query mentions."""
    problems = []
    for where, q in queries.items():
        mentioned = set()
        for sample, matchers in _SELECTOR.findall(q):
            base = base_metric(sample)
            if base not in SPEC_METRICS:
                continue  # unknown names are reported by the name check
            allowed = SPEC_METRICS[base][1] | TARGET_LABELS | ({"le"} if sample.endswith("_bucket") else set())
            for label in _MATCHER.findall(matchers):
                if label not in allowed:
                    problems.append(f"{where}: {sample} has no label {label!r}")
        for sample in _METRIC.findall(q):
            base = base_metric(sample)
            if base in SPEC_METRICS:
                mentioned |= SPEC_METRICS[base][1] | ({"le"} if sample.endswith("_bucket") else set())
        for group in _GROUPING.findall(q):
            for label in (s.strip() for s in group.split(",")):
                if label and label not in mentioned | TARGET_LABELS:
                    problems.append(f"{where}: grouping by {label!r}, which none of its metrics has")
    return problems


def write_dashboard_rules(path: Path) -> Path:
    """The dashboard's queries as recording rules, so that `promtool check rules` parses each one."""
    rules = [{"record": f"dashboard:panel_{i}", "expr": q} for i, q in enumerate(dashboard_queries().values())]
    path.write_text(yaml.safe_dump({"groups": [{"name": "qtrel-dashboard", "rules": rules}]}, sort_keys=False))
    return path


def write_k8s_scrape_static(path: Path) -> Path:
    """The in-cluster scrape configuration with Kubernetes discovery swapped for a static target, for a
    promtool built without Kubernetes discovery (Debian's): everything else is still checked."""
    cfg = yaml.safe_load(K8S_SCRAPE.read_text())
    cfg["rule_files"] = [str((K8S_SCRAPE.parent / f).resolve()) for f in cfg.get("rule_files", [])]
    for job in cfg["scrape_configs"]:
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": ["127.0.0.1:8080"]}]
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main(argv: list[str]) -> int:
    commands = {"dashboard-rules": write_dashboard_rules, "k8s-scrape-static": write_k8s_scrape_static}
    if len(argv) != 2 or argv[0] not in commands:
        print(f"usage: python -m tests.deploy.deployfiles {{{'|'.join(commands)}}} OUT", file=sys.stderr)
        return 2
    commands[argv[0]](Path(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
