"""Proposer kinds, as requests and the --default-proposer flag name them (no torch, no gRPC)."""
from __future__ import annotations

DRAFT, LOOKUP, GUESS, NONE, COMBINED = "draft", "lookup", "guess", "none", "combined"
KINDS = (DRAFT, LOOKUP, GUESS, NONE, COMBINED)
# Predicted Outputs (GenerateRequest.prediction): the guess, re-aligned after a rejection.
# Not a kind a request names: a request names the prediction itself.
PREDICTED_OUTPUT = "prediction"
