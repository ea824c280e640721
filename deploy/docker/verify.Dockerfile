# syntax=docker/dockerfile:1
#
# specdec verify service: CUDA image with a GPU build of torch.
#
#   docker build -f deploy/docker/verify.Dockerfile -t specdec-verify:dev .
#   docker build -f deploy/docker/verify.Dockerfile --build-arg MODEL_DIR=path/in/repo -t specdec-verify:mine .
#
# BASE_IMAGE and TORCH_INDEX_URL go together: the torch wheel index (cuXYZ) must be a
# CUDA version the base image (and the nodes' driver) supports, and TORCH_VERSION must
# be published on that index. The GPU nodes need the NVIDIA driver and container toolkit
# (or the NVIDIA GPU Operator); the image never contains a driver.
#
# A CPU-only verify image (for the local-cpu overlay) builds from the same file:
#   docker build -f deploy/docker/verify.Dockerfile --build-arg BASE_IMAGE=debian:bookworm-slim \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t specdec-verify:cpu .
# (Debian bookworm's python3.11 packages have the same names as Ubuntu's.)
#
# The model in MODEL_DIR (a Hugging Face directory inside the build context) is baked
# in at /models; mounting a volume at /models replaces it at run time.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

# ---- build: a self-contained virtualenv in /opt/venv ---------------------------------
FROM ${BASE_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu's python3.11 packages track the pinned base image's security updates; pinning
# their exact Debian revisions would only make the build break on every archive refresh.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/*

RUN python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: by far the biggest and the least often changed.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY . .
RUN pip install "/src[server]"

# ---- runtime ------------------------------------------------------------------------
FROM ${BASE_IMAGE}

ARG MODEL_DIR=models/stdlib-code-target

LABEL org.opencontainers.image.title="specdec-verify" \
      org.opencontainers.image.description="specdec verify service (GPU): batched target-model verification"

ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

# Same interpreter as the build stage (the venv links to /usr/bin/python3.11). A C compiler
# and Python's headers too: on CUDA, --compile-layers (on by default) runs torch.compile, whose
# Triton kernels build a small C launcher at run time; without them every layer falls back to
# eager, with one warning.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 specdec \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin specdec

COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /usr/local/bin/specdec-healthcheck
COPY --chown=10001:10001 ${MODEL_DIR} /models

USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 9100

# Loading a large target model onto the GPU can take minutes.
# Plaintext probe; with TLS flags, override it (see deploy/k8s/components/mtls for the
# healthcheck's --tls-* options) or disable it with --no-healthcheck.
HEALTHCHECK --interval=30s --timeout=6s --start-period=600s --retries=3 \
    CMD ["python", "/usr/local/bin/specdec-healthcheck", "--service", "specdec.v1.Verify"]

# Extra flags (--max-sessions, --max-connection-age-s, TLS, ...) go in the container arguments.
ENTRYPOINT ["python", "-m", "verify_service", "--model", "/models", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"]
