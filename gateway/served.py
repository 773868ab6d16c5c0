"""The model ids this gateway answers to, and what the orchestrator says of its model.

The first id is the served model's name: --served-model-name's first, else the target's own
(Orchestrator.GetServedModel: its Hugging Face id ORG/NAME, its folder's name, or
SmolLM2-135M-Instruct for the embedded default), as vLLM serves a model under its own id. The other names of --served-model-name are
aliases, and so is `specdec`, the id every earlier gateway required. The orchestrator is asked
once (when first needed, so a gateway may start before it); until it answers, a request's model
id is not checked here (the orchestrator's own error then reaches the caller).
"""
from __future__ import annotations

import logging

import grpc

from gateway.errors import APIError
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc

LEGACY_ID = "specdec"  # the id before served model names; always accepted
log = logging.getLogger(__name__)


def parse_names(text: str) -> tuple[str, ...]:
    """--served-model-name: comma-separated ids, the first the primary one."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    return names


class Served:
    """The ids (configured, or learnt from the orchestrator) and the orchestrator's ServedModel."""

    def __init__(self, names: tuple[str, ...] = ()) -> None:
        self.names = names
        self.info: pb.ServedModel | None = None  # None: not asked yet, or it did not answer

    async def learn(self, channel: grpc.aio.Channel | None, metadata=None) -> pb.ServedModel | None:
        """The orchestrator's ServedModel, asked until it answers (an older one: an empty one)."""
        if self.info is None and channel is not None:
            stub = orchestrator_pb2_grpc.OrchestratorStub(channel)
            try:
                self.info = await stub.GetServedModel(pb.GetServedModelRequest(), metadata=metadata,
                                                      timeout=5)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.info = pb.ServedModel()  # an older orchestrator: no name, no tools
                else:
                    log.debug("GetServedModel: %s", exc.code().name)
        return self.info

    @property
    def ids(self) -> list[str]:
        """Every id accepted, the primary first."""
        own = list(self.names) or ([self.info.model_name] if self.info and self.info.model_name else [])
        return own + ([LEGACY_ID] if LEGACY_ID not in own else [])

    @property
    def primary(self) -> str:
        return self.ids[0]

    def check(self, model: str) -> None:
        """A 404 naming the ids served, unless `model` is one (or the ids are not known yet)."""
        if model in self.ids:
            return
        if not self.names and self.info is None:
            return  # the orchestrator has not said its model's name yet
        raise no_such_model(model, self.ids)

    def cards(self, created: int) -> list[dict]:
        """/v1/models' entries, one per id (vLLM's shape: root and max_model_len)."""
        info = self.info
        root = (info.model_name if info is not None and info.model_name else self.primary)
        extra = {"max_model_len": info.context_length} if info is not None and info.context_length else {}
        return [{"id": name, "object": "model", "created": created, "owned_by": "specdec",
                 "root": root, "parent": None, **extra} for name in self.ids]


def no_such_model(name: str, ids: list[str]) -> APIError:
    served = ", ".join(repr(i) for i in ids)
    return APIError(404, f"The model {name!r} does not exist; this server serves {served}",
                    param="model", code="model_not_found")
