"""What a role package hands the shared bootstrap: its name, verb, servicer and defaults.

The hosting package never asks which role it serves; target_service/role.py
and draft_service/role.py each build one `Role`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engine.host import ModelHost


def keep_model_flags(model: str | None, num_layers: int | None) -> tuple[str | None, int | None]:
    """The default `model_defaults`: serve what --model / --num-layers say."""
    return model, num_layers


@dataclass(frozen=True)
class Role:
    name: str  # "target" / "draft": GetInfo's role, the registry entry, python -m {name}_service
    verb: str  # for --help, e.g. "Score (verify drafted tokens)"
    default_port: int
    service_name: str  # full gRPC service name (health checking, reflection)
    make_servicer: Callable[[ModelHost], Any]
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    model_help: str  # what an omitted --model serves
    layers_help: str = ""  # appended to --num-layers' help
    # (--model, --num-layers) -> what to load; where a role's shipped default lives.
    model_defaults: Callable[[str | None, int | None], tuple[str | None, int | None]] = keep_model_flags
