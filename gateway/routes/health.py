"""GET /health: readiness, from the orchestrator's gRPC health service."""
from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import state
from gateway.errors import APIError

router = APIRouter()


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
        raise APIError(503, f"orchestrator {gw.settings.orchestrator}: {status}",
                       code="orchestrator_unavailable")
    return {"status": "ok", "orchestrator": gw.settings.orchestrator}
