"""An OpenAI-compatible HTTP API in front of a specdec orchestrator.

    python -m gateway --orchestrator 127.0.0.1:50050 --port 8000

A separate process: it holds no model, speaks gRPC to the orchestrator through
`client.AsyncClient`, and scales on its own. See gateway/protocol.py for which
OpenAI parameters are mapped, extended, ignored or refused.
"""
from gateway.app import create_app
from gateway.state import Settings

__all__ = ["Settings", "create_app"]
