# syntax=docker/dockerfile:1
# One image for every SuperInfer service; the command picks which one runs:
#   docker run IMAGE gateway --host 0.0.0.0 --port 8000
#   docker run IMAGE control-plane
#   docker run --gpus all IMAGE data-plane
# (the same `superinfer` subcommands the CLI and the tests use). Settings come from SUPERINFER_*
# environment variables (docs/deployment.md).
#
# Multi-arch (linux/arm64 for GH200 nodes, linux/amd64):
#   docker buildx build --platform linux/arm64,linux/amd64 -t REGISTRY/superinfer:0.1.0 --push .
# CPU-only image (a laptop, the compose `cpu` profile):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#     --build-arg EXTRAS= -t superinfer:cpu .

ARG PYTHON_VERSION=3.11
ARG DEBIAN_RELEASE=bookworm

# ---- build: a virtual environment with torch and the project, compiled to bytecode ----------
FROM python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE} AS build
# torch comes first, from the index that carries the wanted build for the target architecture:
# cu128 has CUDA wheels for both x86_64 and aarch64 (Grace); .../whl/cpu has CPU-only ones.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC="torch>=2.4"
# Project extras: `cuda` adds cuda-python (the batched cudaMemcpyBatchAsync transfer backend).
ARG EXTRAS=cuda
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/superinfer
ENV PATH=/opt/superinfer/bin:$PATH
# The torch version is the build argument TORCH_SPEC (pin it there for a reproducible image).
# hadolint ignore=DL3013
RUN pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY superinfer ./superinfer
COPY shared ./shared
COPY data_plane ./data_plane
COPY control_plane ./control_plane
COPY gateway ./gateway
COPY lab ./lab
# The project from this checkout; its dependencies as pyproject.toml bounds them.
# hadolint ignore=DL3013
RUN pip install ".${EXTRAS:+[${EXTRAS}]}" \
    && superinfer --help > /dev/null \
    && python -m compileall -q -j 0 /opt/superinfer/lib
# The CPU kernels (data_plane/models/cpu_*.c) for a baseline CPU of the target
# architecture: the runtime image has no compiler to build them natively at first use.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && models="$(python -c 'import data_plane.models as m, os; print(os.path.dirname(m.__file__))')" \
    && case "$(uname -m)" in x86_64) march=x86-64-v3 ;; *) march=armv8-a ;; esac \
    && gcc -O3 -march="${march}" -fno-math-errno -fassociative-math -fno-signed-zeros \
       -fno-trapping-math -shared -fPIC -fopenmp "${models}/cpu_attention.c" \
       "${models}/cpu_matmul.c" "${models}/cpu_dense.c" "${models}/cpu_decode_layer.c" \
       -o "${models}/cpu_attention_prebuilt.so" -lm \
    && rm -rf /var/lib/apt/lists/*

# ---- runtime: the environment only, a non-root user, no compilers --------------------------
FROM python:${PYTHON_VERSION}-slim-${DEBIAN_RELEASE} AS runtime
ARG UID=10001
LABEL org.opencontainers.image.title="superinfer" \
      org.opencontainers.image.description="SLO-aware LLM serving: gateway, control plane, data plane" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid "${UID}" superinfer \
    && useradd --no-log-init --uid "${UID}" --gid "${UID}" --home-dir /home/superinfer \
       --create-home --shell /usr/sbin/nologin superinfer
COPY --from=build /opt/superinfer /opt/superinfer
# Everything that might write goes to /tmp, so the root file system can be mounted read-only
# (Kubernetes readOnlyRootFilesystem, compose read_only) with an emptyDir/tmpfs at /tmp.
ENV PATH=/opt/superinfer/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/superinfer \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.inductor \
    HF_HOME=/tmp/.hf \
    HF_HUB_OFFLINE=1
USER ${UID}:${UID}
WORKDIR /home/superinfer
# 8000: the gateway's API (and its /health, /ready, /metrics); 9090: the health/metrics port of
# the data plane and control plane (SUPERINFER_HEALTH_PORT).
EXPOSE 8000 9090
STOPSIGNAL SIGTERM
# Probes /health on SUPERINFER_HEALTH_PORT, else SUPERINFER_PORT, else 8000 (shared/health.py).
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "shared.health"]
ENTRYPOINT ["superinfer"]
CMD ["--help"]
