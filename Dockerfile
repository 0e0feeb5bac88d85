# qtrel: query-title relevance scoring service.
#
#   CPU (default):  docker build -t qtrel:cpu .
#   CUDA:           docker build --build-arg VARIANT=cuda -t qtrel:cuda .
#   Other base:     docker build --build-arg BASE_IMAGE=registry.example/python:3.11-slim-bookworm .
#
# Both stages use the same base so that the virtual environment built in the first one finds the same
# Python at the same path in the second. The default model ships inside the Python package
# (model/default/), so installing the package bakes it in. The service reads all of its settings
# from QTREL_* environment variables (see docs/deployment.md).

ARG BASE_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build

# cpu: PyTorch's CPU-only wheel. cuda: PyTorch's CUDA wheel, which carries its CUDA runtime libraries
# as pip packages, so the same slim base serves; the host only needs the NVIDIA driver and runtime.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# A wheel tag that the PyTorch index has for TORCH_VERSION (https://download.pytorch.org/whl/).
ARG CUDA_TAG=cu128
# Overrides the index chosen from VARIANT (a mirror, say). Empty: the public PyTorch index.
ARG TORCH_INDEX_URL=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first and on its own: it is most of the image and changes far less often than the code.
# Then drop what serving never uses: C++ headers (for extensions and torch.compile, which would also
# need a compiler the runtime image does not have), protoc, and torch's own C++ test executables
# (about 150 MB in all).
RUN set -eu; \
    case "$VARIANT" in \
      cpu)  index="https://download.pytorch.org/whl/cpu" ;; \
      cuda) index="https://download.pytorch.org/whl/${CUDA_TAG}" ;; \
      *)    echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --index-url "${TORCH_INDEX_URL:-$index}" "torch==${TORCH_VERSION}"; \
    site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    rm -rf "$site/torch/include" "$site/torch/test" "$site"/torch/bin/test_* "$site"/torch/bin/*Test \
           "$site"/torch/bin/protoc*

# A C compiler, in this stage only: the package's one compiled part, the fused attention kernel
# (model/engines/_kernels.c, plain C), is built by the install below; the runtime stage gets the built library
# with /opt/venv, not the compiler. Without it the install would still succeed and the service would run
# torch's slower attention kernel (/info: model.attention). DL3008 (apt versions unpinned) is ignored:
# Debian's security updates replace pinned patch levels, and the compiler never reaches the image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The package, its other dependencies and the default model inside it. A regular (not editable)
# install: the runtime stage copies only /opt/venv, never the sources.
COPY . /src
# Readable by the runtime user whatever the build context's modes were (a checkpoint written with
# private 0600 files, say): root owns the files, everyone may read them, no one else may write.
RUN pip install /src \
    && pip uninstall --yes pip \
    && chmod -R a+rX,go-w /opt/venv

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime

ARG VARIANT=cpu

LABEL org.opencontainers.image.title="qtrel" \
      org.opencontainers.image.description="Query-title relevance scoring service (BERT cross-encoder)" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed numeric uid/gid so that Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
# --no-log-init: no sparse lastlog/faillog entries sized by the high uid.
RUN groupadd --gid 10001 qtrel \
    && useradd --no-log-init --uid 10001 --gid qtrel --home-dir /home/qtrel --create-home \
       --shell /usr/sbin/nologin qtrel \
    && install -d -o 10001 -g 10001 /var/lib/qtrel/jobs
# Score jobs' folder (QTREL_JOBS_DIR, off unless set): a volume mounted here starts owned by qtrel.
VOLUME /var/lib/qtrel/jobs

COPY --from=build /opt/venv /opt/venv

# The device follows the variant: the variant names are the device names (cpu, cuda).
# QTREL_HOST: inside a container the service must listen on all interfaces, not only on loopback.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    QTREL_HOST=0.0.0.0 \
    QTREL_PORT=8080 \
    QTREL_DEVICE=${VARIANT}

USER 10001:10001
WORKDIR /home/qtrel
EXPOSE 8080

# Ready means model loaded, warmed up and not draining; /health/ready answers 503 otherwise, which
# urlopen raises as an error, so the exit status is 1. Slim images have no curl, hence Python.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('QTREL_PORT', '8080') + '/health/ready', timeout=2)"]

# Exec form: `qtrel` is PID 1 and receives SIGTERM itself (readiness goes to 503, the queue drains,
# the process exits), with no shell in between to swallow the signal.
ENTRYPOINT ["qtrel"]
CMD ["serve"]
