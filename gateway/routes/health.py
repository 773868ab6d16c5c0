"""GET /health: readiness, from the orchestrator's gRPC health service; GET /health/live: liveness.

Both answer anyone, even while tokens are required (gateway.guard.open_to_anyone), so they say
nothing about the deployment: the orchestrator's address and status go to the log, not the body.
"""
from __future__ import annotations

import logging

import grpc
from fastapi import APIRouter, Request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import state
from gateway.errors import APIError

router = APIRouter()
log = logging.getLogger("gateway")


@router.get("/health")
async def health(request: Request) -> dict:
    """200 while the orchestrator reports SERVING, else 503 (readiness)."""
    gw = state.of(request)
    stub = health_pb2_grpc.HealthStub(gw.channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        status = f"{exc.code().name}: {exc.details()}"
    if status != "SERVING":
        log.warning("not ready: orchestrator %s answers %s", gw.settings.orchestrator, status)
        raise APIError(503, "the orchestrator is not serving", code="orchestrator_unavailable")
    return {"status": "ok"}


@router.get("/health/live")
async def live() -> dict:
    """200 while this process answers (liveness): the orchestrator is not asked."""
    return {"status": "ok"}
