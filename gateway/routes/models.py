"""GET /v1/models and /v1/models/{model_id}: the model this gateway serves, under each of its ids."""
from __future__ import annotations

from fastapi import APIRouter, Request

from gateway import state
from gateway.served import no_such_model

router = APIRouter()


def _authorization(request: Request):
    auth = request.headers.get("authorization")
    return (("authorization", auth),) if auth else None


@router.get("/v1/models")
async def models(request: Request) -> dict:
    gw = state.of(request)
    await gw.served.learn(gw.channel, _authorization(request))
    return {"object": "list", "data": gw.served.cards(gw.created)}


@router.get("/v1/models/{model_id:path}")  # a Hugging Face id has a slash: ORG/NAME
async def model(model_id: str, request: Request) -> dict:
    gw = state.of(request)
    await gw.served.learn(gw.channel, _authorization(request))
    for card in gw.served.cards(gw.created):
        if card["id"] == model_id:
            return card
    raise no_such_model(model_id, gw.served.ids)
