"""python -m draft_service --help"""
from __future__ import annotations

import sys

from draft_service.servicer import DEFAULT_PORT, SERVICE_NAME, DraftServicer
from specdec.hosting.service import main
from specdec.v1 import model_pb2_grpc

if __name__ == "__main__":
    sys.exit(
        main("draft", DraftServicer, model_pb2_grpc.add_DraftServiceServicer_to_server,
             SERVICE_NAME, DEFAULT_PORT)
    )
