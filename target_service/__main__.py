"""python -m target_service --help"""
from __future__ import annotations

import sys

from target_service.servicer import DEFAULT_PORT, SERVICE_NAME, TargetServicer
from specdec.hosting.service import main
from specdec.v1 import model_pb2_grpc

if __name__ == "__main__":
    sys.exit(
        main("target", TargetServicer, model_pb2_grpc.add_TargetServiceServicer_to_server,
             SERVICE_NAME, DEFAULT_PORT)
    )
