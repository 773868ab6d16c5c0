"""Names of the built-in proposer kinds that code refers to by name (no torch, no gRPC).

The kinds themselves, with their summaries, capabilities and homes, are declared once in
orchestrator.proposers.registry; every list of kinds derives from it.
"""
from __future__ import annotations

DRAFT = "draft"
LOOKUP = "lookup"
GUESS = "guess"
NONE = "none"
COMBINED = "combined"
SUFFIX = "suffix"
# Predicted Outputs (GenerateRequest.prediction): the guess, re-aligned after a rejection.
# Not a kind a request names: a request names the prediction itself.
PREDICTED_OUTPUT = "prediction"
