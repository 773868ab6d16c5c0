"""The draft role for the shared bootstrap: its verb, port, servicer and the shipped-draft default.

Without --model the draft service serves the draft distilled from the embedded
target (python -m distill), shipped as package data in
specdec/drafts/smollm2-135m; if that folder is absent, or --num-layers is
given, it serves an early exit of the embedded model (first 2 layers by default).
"""
from __future__ import annotations

from pathlib import Path

import specdec
from draft_service.servicer import DraftServicer
from engine.model.drafts import is_draft_folder
from model_service.role import Role
from specdec.v1 import model_pb2, model_pb2_grpc

DEFAULT_PORT = 50062
DEFAULT_DRAFT = Path(specdec.__file__).resolve().parent / "drafts" / "smollm2-135m"  # package data
EARLY_EXIT_LAYERS = 2  # the stand-in draft when no distilled draft is shipped


def default_draft() -> str | None:
    """The shipped distilled draft for the embedded default target, if this install has one."""
    return str(DEFAULT_DRAFT) if is_draft_folder(DEFAULT_DRAFT) else None


def model_defaults(model: str | None, num_layers: int | None) -> tuple[str | None, int | None]:
    """(--model, --num-layers) -> what to serve: the shipped draft, else an early exit."""
    if num_layers is None and not model:
        model = default_draft()
        if not model:
            num_layers = EARLY_EXIT_LAYERS
    return model, num_layers


ROLE = Role(
    name="draft",
    verb="Propose (draft k tokens)",
    default_port=DEFAULT_PORT,
    service_name=model_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name,
    make_servicer=DraftServicer,
    add_to_server=model_pb2_grpc.add_DraftServiceServicer_to_server,
    model_help="the shipped distilled draft (see --num-layers)",
    layers_help="; without --model the committed distilled draft (specdec/drafts/smollm2-135m) is "
                "served, or, if absent or with --num-layers, the embedded model's first N "
                f"layers (default {EARLY_EXIT_LAYERS})",
    model_defaults=model_defaults,
)
