"""GET /v1/models and /v1/models/{model_id}: the one model this gateway serves."""
from __future__ import annotations

from fastapi import APIRouter, Request

from gateway import state
from gateway.errors import APIError

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": [_model_card(state.of(request))]}


@router.get("/v1/models/{model_id}")
async def model(model_id: str, request: Request) -> dict:
    gw = state.of(request)
    if model_id != gw.settings.model_name:
        raise no_such_model(model_id)
    return _model_card(gw)


def _model_card(gw: state.Gateway) -> dict:
    return {"id": gw.settings.model_name, "object": "model", "created": gw.created,
            "owned_by": "specdec"}


def no_such_model(name: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist (this server serves the model "
                         "listed by /v1/models)", param="model", code="model_not_found")
