"""specdec client library: `Client` / `AsyncClient` for the orchestrator's gRPC API."""
from client.api import (
    AsyncClient, AsyncStream, Chunk, Client, Completion, Stats, Stream, build_request,
    build_tokenize_request,
)

__all__ = ["AsyncClient", "AsyncStream", "Chunk", "Client", "Completion", "Stats", "Stream", "build_request",
           "build_tokenize_request"]
