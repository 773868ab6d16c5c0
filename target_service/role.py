"""The target role for the shared bootstrap: its verb, port, servicer and model default."""
from __future__ import annotations

from model_service.role import Role
from specdec.v1 import model_pb2, model_pb2_grpc
from target_service.servicer import TargetServicer

DEFAULT_PORT = 50061

ROLE = Role(
    name="target",
    verb="Score (verify drafted tokens)",
    default_port=DEFAULT_PORT,
    service_name=model_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name,
    make_servicer=TargetServicer,
    add_to_server=model_pb2_grpc.add_TargetServiceServicer_to_server,
    model_help="the embedded SmolLM2-135M-Instruct (converted once to a cached folder)",
)
