#!/usr/bin/env bash
# Build the CPU image for real and start the service from it, without a Docker engine.
#
#   sudo docker/verify-image.sh            # from the repository root; needs root
#
# Where there is no Docker engine and `podman run` cannot start containers (a sandbox, a VM without
# cgroup delegation), this still proves the image: podman builds the Dockerfile as written, on a
# Debian bookworm base made locally with debootstrap (bookworm ships Python 3.11, like the default
# python:3.11-slim-bookworm base), then the image is mounted and the service is started from it in a
# chroot, as the image's user, with the image's environment, on loopback. It scores one pair, runs the
# image's own HEALTHCHECK command, puts a short load on it, sends SIGTERM and checks that the process
# drains and exits. It prints the image size, the time to ready, memory, pairs/s and the time to exit.
#
# Needs: apt-get install -y podman debootstrap (and root). Slow (minutes): not part of CI.
#
# Environment:
#   QTREL_VERIFY_WORK   work folder for the base root filesystem and the logs (default /var/tmp/qtrel-image)
#   QTREL_VERIFY_PORT   loopback port for the service (default 18080)
#   QTREL_VERIFY_TAG    image tag to build (default localhost/qtrel:cpu)
#   DEBIAN_MIRROR       mirror for debootstrap (default http://deb.debian.org/debian)
#   PIP_WHEELS          a folder of wheels the build may use besides the indexes (default /opt/wheels if
#                       it exists), for sandboxes where the PyTorch index cannot be reached
#   QTREL_VERIFY_MODEL  a checkpoint folder to serve instead of the model baked into the image, mounted
#                       read-only at /tmp/model with QTREL_MODEL=/tmp/model (like docker run -v ... -e ...)
#   LOAD_SECONDS        seconds of load after the first score, 0 for none (default 10), from
#   LOAD_CLIENTS        concurrent clients (default 8) sending
#   LOAD_PAIRS          titles per request (default 32): a smoke figure, not the benchmark
#   BUILD_ONLY=1        stop after the build and the size report
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${QTREL_VERIFY_WORK:-/var/tmp/qtrel-image}"
PORT="${QTREL_VERIFY_PORT:-18080}"
TAG="${QTREL_VERIFY_TAG:-localhost/qtrel:cpu}"
BASE="localhost/qtrel-base:bookworm"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
WHEELS="${PIP_WHEELS:-/opt/wheels}"
MODEL_DIR="${QTREL_VERIFY_MODEL:-}"

say() { printf '\n== %s\n' "$*"; }
die() { printf 'verify-image: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, podman's storage, chroot)"
for tool in podman debootstrap curl chroot unshare; do
    command -v "$tool" >/dev/null || die "$tool not found (apt-get install -y podman debootstrap curl)"
done
mkdir -p "$WORK"

# --- 1. Base image: Debian bookworm with Python 3.11, made here, like python:3.11-slim-bookworm -----
if podman image exists "$BASE"; then
    say "base image $BASE already present"
else
    if [ ! -x "$WORK/rootfs/usr/bin/python3" ]; then
        say "debootstrap bookworm into $WORK/rootfs"
        rm -rf "$WORK/rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
            bookworm "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
            || die "debootstrap failed, see $WORK/debootstrap.log"
    fi
    # What a slim image leaves out: package caches and lists, documentation, manual pages, locales.
    rm -rf "$WORK"/rootfs/var/cache/apt/archives/*.deb "$WORK"/rootfs/var/lib/apt/lists/* \
           "$WORK"/rootfs/usr/share/doc/* "$WORK"/rootfs/usr/share/man/* "$WORK"/rootfs/usr/share/info/*
    find "$WORK/rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} +
    say "import it as $BASE"
    # The official python images set PATH and LANG in their configuration; an imported tarball has
    # no configuration, so give it the same.
    tar -C "$WORK/rootfs" -c . | podman import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' - "$BASE" >/dev/null
fi

# --- 2. Build ----------------------------------------------------------------------------------------
# The Dockerfile is built as written. Only the build container's view of pip changes, through
# build-time mounts that do not end up in the image: this host's CA bundle (for an intercepting
# proxy) and, when given, a local folder of wheels with PyPI as a further index (for a sandbox where
# the PyTorch index cannot be reached; pip then takes torch==2.13.0+cpu from the folder).
build_mounts=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
pip_conf="$WORK/pip.conf"
{
    echo "[global]"
    echo "cert = /etc/ssl/certs/ca-certificates.crt"
    if [ -d "$WHEELS" ]; then
        echo "find-links = /wheels"
        echo "extra-index-url = https://pypi.org/simple"
        echo "timeout = 30"
        echo "retries = 1"
    fi
} >"$pip_conf"
build_mounts+=(-v "$pip_conf:/etc/pip.conf:ro")
[ -d "$WHEELS" ] && build_mounts+=(-v "$WHEELS:/wheels:ro")

if [ ! -d "$ROOT/model/default" ] && [ -z "$MODEL_DIR" ] && [ "${BUILD_ONLY:-0}" != 1 ]; then
    die "$ROOT/model/default is missing, so the image has no default model: set QTREL_VERIFY_MODEL or BUILD_ONLY=1"
fi

say "podman build $TAG (base $BASE)"
t0=$(date +%s)
podman build --isolation=chroot --format docker --layers \
    "${build_mounts[@]}" \
    --build-arg BASE_IMAGE="$BASE" \
    -t "$TAG" -f "$ROOT/Dockerfile" "$ROOT" 2>&1 | tee "$WORK/build.log"
build_s=$(( $(date +%s) - t0 ))

size_bytes=$(podman image inspect --format '{{.Size}}' "$TAG")
base_bytes=$(podman image inspect --format '{{.Size}}' "$BASE")
say "image $TAG: $((size_bytes / 1000000)) MB (base $((base_bytes / 1000000)) MB), built in ${build_s}s"
podman history --format '{{.Size}}\t{{.CreatedBy}}' "$TAG" | cut -c1-150 | head -20

[ "${BUILD_ONLY:-0}" = 1 ] && exit 0

# --- 3. Start the service from the image, as the image would --------------------------------------
inspect() { podman image inspect --format "$1" "$TAG"; }
user="$(inspect '{{.Config.User}}')"
workdir="$(inspect '{{.Config.WorkingDir}}')"
mapfile -t image_env < <(inspect '{{range .Config.Env}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t entrypoint < <(inspect '{{range .Config.Entrypoint}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t cmd < <(inspect '{{range .Config.Cmd}}{{println .}}{{end}}' | sed '/^$/d')
mapfile -t healthcheck < <(inspect '{{range .Config.Healthcheck.Test}}{{println .}}{{end}}' | sed '/^$/d')
case "${user%%:*}" in ""|0|root) die "image runs as root ('$user')" ;; esac
echo "user=$user workdir=$workdir entrypoint=${entrypoint[*]} cmd=${cmd[*]}"
echo "env: ${image_env[*]}"

mnt="$(podman image mount "$TAG")"
server_pid=""
cleanup() {
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
    podman image unmount "$TAG" >/dev/null 2>&1 || true
}
trap cleanup EXIT

# Run a command inside the image: private mount namespace with /proc, /dev and a writable /tmp on the
# read-only image (as with readOnlyRootFilesystem in the manifests),
# the image's user, working folder and environment (plus QTREL_HOST/PORT for loopback), no host
# environment. The network namespace is the host's, hence loopback.
run_env=("${image_env[@]}" QTREL_HOST=127.0.0.1 QTREL_PORT="$PORT")
[ -n "$MODEL_DIR" ] && run_env+=(QTREL_MODEL=/tmp/model)
# shellcheck disable=SC2016  # the single-quoted scripts expand their own arguments, inside the namespace
in_image() {
    unshare --mount -- sh -c '
        mnt="$1"; model="$2"; shift 2
        mount --bind /proc "$mnt/proc" && mount --bind /dev "$mnt/dev" && mount -t tmpfs tmpfs "$mnt/tmp" || exit 1
        if [ -n "$model" ]; then
            mkdir "$mnt/tmp/model" && mount --bind -o ro "$model" "$mnt/tmp/model" || exit 1
        fi
        exec "$@"' sh "$mnt" "$MODEL_DIR" \
        chroot --userspec="$user" "$mnt" /usr/bin/env -i "${run_env[@]}" \
        /bin/sh -c 'cd "$0" && exec "$@"' "$workdir" "$@"
}

url="http://127.0.0.1:$PORT"
say "start ${entrypoint[*]} ${cmd[*]} from the image on $url"
ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
t0=$(date +%s%N)
in_image "${entrypoint[@]}" "${cmd[@]}" >"$WORK/serve.log" 2>&1 &
server_pid=$!
ready=""
for _ in $(seq 1 600); do
    kill -0 "$server_pid" 2>/dev/null || { cat "$WORK/serve.log"; die "the service exited before ready"; }
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health/ready")" = 200 ]; then ready=1; break; fi
    sleep 0.5
done
[ -n "$ready" ] || { tail -50 "$WORK/serve.log"; die "not ready after 300s"; }
ready_ms=$(ms_since "$t0")
say "ready after ${ready_ms} ms"
# unshare, sh, chroot, env and sh all exec, so the entrypoint process is the direct child of the
# background subshell: the process a container runtime would signal as PID 1.
target="$(pgrep -P "$server_pid" | head -1)"
[ -n "$target" ] || die "cannot find the service process"
# The server and its model processes (their children); shared pages are counted once per process.
tree_rss_kb() { ps -o rss= -p "$target" --ppid "$target" | awk '{s += $1} END {print s}'; }
rss_ready_mb=$(( $(tree_rss_kb) / 1024 ))
echo "resident memory when ready (server + model processes): ${rss_ready_mb} MB"

say "POST /score"
body='{"query": "cordless drill", "titles": ["DEWALT 20-Volt MAX Lithium-Ion Cordless Drill/Driver Kit"]}'
answer="$(curl -sS --fail-with-body -H 'content-type: application/json' -d "$body" "$url/score")" \
    || { echo "$answer"; die "/score failed"; }
echo "$answer"
curl -sS "$url/info"; echo

if [ "${LOAD_SECONDS:-10}" -gt 0 ]; then
    say "load: ${LOAD_CLIENTS:-8} clients x ${LOAD_PAIRS:-32} pairs per request for ${LOAD_SECONDS:-10}s"
    python3 - "$url" "${LOAD_CLIENTS:-8}" "${LOAD_PAIRS:-32}" "${LOAD_SECONDS:-10}" <<'EOF' | tee "$WORK/load.out"
import json, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor

url, clients, pairs, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
titles = [f"DEWALT 20-Volt MAX cordless drill driver kit with {i} bits and a carrying case" for i in range(pairs)]
body = json.dumps({"query": "cordless drill with bits", "titles": titles}).encode()

def client(_):
    lat, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.monotonic()
        req = urllib.request.Request(url + "/score", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        lat.append(time.monotonic() - t)
    return lat

t0 = time.monotonic()
with ThreadPoolExecutor(clients) as pool:
    lat = sorted(x for part in pool.map(client, range(clients)) for x in part)
wall = time.monotonic() - t0
q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1000
print(f"requests {len(lat)}; pairs/s {len(lat) * pairs / wall:.0f}; "
      f"latency p50 {q(0.5):.0f} ms, p99 {q(0.99):.0f} ms")
EOF
    rss_load_mb=$(( $(tree_rss_kb) / 1024 ))
    echo "resident memory after load: ${rss_load_mb} MB"
fi

say "the image's HEALTHCHECK: ${healthcheck[*]}"
[ "${healthcheck[0]:-}" = CMD ] || die "no exec-form HEALTHCHECK in the image"
in_image "${healthcheck[@]:1}" && echo "healthcheck: healthy (exit 0)"

say "SIGTERM: the service drains and exits"
t0=$(date +%s%N)
kill -TERM "$target"
wait "$server_pid" && rc=0 || rc=$?
exit_ms=$(ms_since "$t0")
server_pid=""
echo "exit status $rc after ${exit_ms} ms"
tail -5 "$WORK/serve.log"

say "summary"
printf 'image %s: %s MB (base %s MB); build %ss; ready in %s ms; RSS %s MB ready, %s MB after load\n' \
    "$TAG" "$((size_bytes / 1000000))" "$((base_bytes / 1000000))" "$build_s" "$ready_ms" \
    "$rss_ready_mb" "${rss_load_mb:-?}"
[ -s "$WORK/load.out" ] && [ "${LOAD_SECONDS:-10}" -gt 0 ] && echo "load: $(cat "$WORK/load.out")"
printf 'exit on SIGTERM in %s ms (status %s)\n' "$exit_ms" "$rc"
# uvicorn re-raises the SIGTERM it handled once it has shut down, so outside a container the status
# is 143 (128 + 15); as a container's PID 1 the re-raised signal is ignored and the status is 0.
# Either is clean if the server got to the end of its shutdown.
case "$rc" in
    0|143) grep -q "Finished server process" "$WORK/serve.log" || die "no orderly shutdown in the log" ;;
    *) die "the service exited with status $rc on SIGTERM" ;;
esac
