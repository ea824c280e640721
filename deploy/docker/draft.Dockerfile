# syntax=docker/dockerfile:1
#
# specdec draft service: slim CPU image.
#
#   docker build -f deploy/docker/draft.Dockerfile -t specdec-draft:dev .
#   docker build -f deploy/docker/draft.Dockerfile --build-arg MODEL_DIR=path/in/repo -t specdec-draft:mine .
#
# The model in MODEL_DIR (a Hugging Face directory inside the build context) is baked
# in at /models; mounting a volume at /models replaces it at run time.

ARG PYTHON_IMAGE=python:3.11.10-slim-bookworm

# ---- build: a self-contained virtualenv in /opt/venv ---------------------------------
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

# A C compiler in this stage only: the CPU tier's kernels (the row kernel and the query attention,
# specdec/engine/cpu/) are prebuilt into the installed package below; the runtime has none.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: by far the biggest and the least often changed.
# The CPU index keeps the CUDA libraries (several GB) out of this image.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY . .
# -P: the installed package, not /src's copy (the working directory), is where the library goes.
RUN pip install "/src[server]" \
 && python -P -m specdec.engine.cpu.kernel

# ---- runtime ------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}

ARG MODEL_DIR=models/stdlib-code-draft

LABEL org.opencontainers.image.title="specdec-draft" \
      org.opencontainers.image.description="specdec draft service (CPU): drafts tokens, streams to a verify service"

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    HF_HOME=/tmp/hf \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    OMP_NUM_THREADS=2

# Fixed numeric ids so Kubernetes can check runAsNonRoot without reading /etc/passwd.
RUN groupadd --system --gid 10001 specdec \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin specdec

COPY --from=build /opt/venv /opt/venv
COPY deploy/docker/healthcheck.py /usr/local/bin/specdec-healthcheck
COPY --chown=10001:10001 ${MODEL_DIR} /models

USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 8000 9100

# Model loading can take a while: give it a generous start period. This check speaks
# plaintext: a draft served with --tls-cert needs its own (specdec-healthcheck --tls-ca ...).
HEALTHCHECK --interval=30s --timeout=6s --start-period=120s --retries=3 \
    CMD ["python", "/usr/local/bin/specdec-healthcheck", "--service", "specdec.v1.Draft"]

# The verify address has no sensible default: pass `--verify HOST:PORT` (plus any
# other flags) as the container command arguments, e.g. `docker run IMAGE --verify verify:50051`.
ENTRYPOINT ["python", "-m", "draft_service", "--model", "/models", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9100"]
